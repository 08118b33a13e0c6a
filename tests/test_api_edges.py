"""The Python API's errors name what is wrong, and its test metrics say they are test metrics.

- Evaluating an algorithm that keeps per-client values (Ditto's personal models, local
  models, one-shot's and CFL's cluster assignments) on data of another number of clients
  is one ValueError naming both counts, not a raw vmap or broadcasting error.
- A NaN or inf in a client's real rows names the array, its shape, the client and row.
- `simulate.default_evaluate(..., prefix="test_")` names its metrics `test_*`, with the
  values of a plain per-client loop written here.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import make_ragged, np_client_loss
from fedjax_sim import simulate
from fedjax_sim.algorithms import ALGORITHMS, fedavg, sgd
from fedjax_sim.data import FederatedData
from fedjax_sim.models import linear_regression

PER_CLIENT = {"ditto": "Ditto's personal models", "local": "The local models",
              "oneshot": "The clients' cluster assignments",
              "cfl": "The clients' cluster assignments"}


@pytest.mark.parametrize("name", sorted(PER_CLIENT))
def test_evaluating_other_clients_names_both_counts(name, linear_model):
    train = make_ragged(0)                                           # 5 clients
    test = make_ragged(1, sizes=(2, 3, 1), clusters=(0, 1, 0))     # 3 clients
    kwargs = {"num_clusters": 2, "pretraining": sgd(0.1, steps=2)} if name == "oneshot" else {}
    algorithm = ALGORITHMS[name](linear_model, sgd(0.1), **kwargs)
    state = algorithm.init(jax.random.key(0), train)
    with pytest.raises(ValueError) as err:
        algorithm.evaluate(state, test)
    assert str(err.value) == (
        f"{PER_CLIENT[name]} are per client: the state holds 5 clients, the evaluated data 3; "
        "evaluate on the clients it was trained on (their test rows, in the same order).")
    assert set(algorithm.evaluate(state, make_ragged(2))) >= {"client_loss"}  # same 5: fine


@pytest.mark.parametrize(("bad", "where"), [((1, 0, 1), "client 1, row 0"),
                                            ((3, 2, 0), "client 3, row 2")])
def test_a_non_finite_input_names_the_client_row_and_shape(bad, where):
    sizes = (4, 1, 0, 3, 2)
    x = np.zeros((5, 4, 3), np.float32)
    x[bad] = np.nan
    x[2, 1, 0] = np.inf  # padding of the empty client: not data, not refused
    with pytest.raises(ValueError) as err:
        FederatedData.from_arrays(x, np.zeros((5, 4), np.float32), num_examples=np.array(sizes))
    assert str(err.value) == (f"x (shape (5, 4, 3)) has NaN or inf values in 1 real (unpadded) "
                              f"row, the first at {where}.")


def test_default_evaluate_prefixes_the_test_metrics():
    train, test = make_ragged(0), make_ragged(1)
    model = linear_regression(3)
    algorithm = fedavg(model, sgd(0.1, steps=2))
    state, history = simulate.run(
        algorithm, train, jax.random.key(0), rounds=2, eval_every=2, progress=False,
        evaluate=simulate.default_evaluate(algorithm, test, prefix="test_"))
    row = history[-1]
    assert {"test_loss", "test_loss_worst"} <= set(row) and "loss" not in row
    theta = np.asarray(state.params, np.float64)
    losses = [np_client_loss(theta, np.asarray(test.x[i]), np.asarray(test.y[i]),
                             int(test.num_examples[i])) for i in range(test.num_clients)
              if int(test.num_examples[i]) > 0]
    np.testing.assert_allclose(row["test_loss"], np.mean(losses), rtol=1e-5)
    np.testing.assert_allclose(row["test_loss_worst"], np.max(losses), rtol=1e-5)
    plain = simulate.default_evaluate(algorithm, test)(state)  # no prefix: as before
    assert plain == {k.removeprefix("test_"): v for k, v in
                     simulate.default_evaluate(algorithm, test, prefix="test_")(state).items()}
