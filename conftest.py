"""Repo-root pytest configuration, loaded before any test or notebook is collected.

`notebooks/quickstart.ipynb` runs at full (paper) size by default, which takes
minutes. Under pytest it runs through nbmake (`pytest --nbmake notebooks/`) in a
fresh Jupyter kernel; that kernel is a child process and inherits this process's
environment. Setting FEDJAX_SIM_NOTEBOOK_SMALL=1 here, at import time, makes the
notebook pick its seconds-long SMALL size. `setdefault` keeps an explicit
FEDJAX_SIM_NOTEBOOK_SMALL=0 from the caller, to test the full size on purpose.
"""

import os

os.environ.setdefault("FEDJAX_SIM_NOTEBOOK_SMALL", "1")
