"""pfl-research's own PyTorch path on the CIFAR-10 benchmark configuration, timed.

Run by `standard_workloads.py` with the Python of the venv it creates (pfl and torch
installed there, not fedjax_sim), on the data it writes: one .npz holding the training
images and labels, the users (index rows into them) and the test images. It builds what
pfl-research's `pfl:benchmarks/image_classification/pytorch/train.py` builds for
`configs/baseline.yaml`, from pfl's public API: the users as a `FederatedDataset` sampled
by pfl's "random" user sampler, its `simple_cnn` (the same layers, written here in
PyTorch), `PyTorchModel` with local SGD and a central SGD optimizer, a `SimulatedBackend`
weighting every user alike (`WeightByUser`), and `FederatedAveraging` for `rounds`
central iterations. Images are standardized per channel by the training images'
statistics, as pfl's loader does.

It first times central evaluations of the whole test set (`PyTorchModel.evaluate`, batch
10 000, as pfl's `CentralEvaluationCallback` calls it) on the initial model, then runs the
iterations, printing after each one a JSON object: the seconds each central iteration
ended after the previous one (the first measured from the start of `algorithm.run`) and
the evaluations' seconds; the last object has "finished": true.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help=".npz written by standard_workloads.py")
    parser.add_argument("--rounds", type=int, required=True, help="central iterations to run")
    parser.add_argument("--threads", type=int, required=True, help="torch intra-op threads")
    parser.add_argument("--cpus", default="", help="comma list of CPUs to pin this process to")
    parser.add_argument("--cohort", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--central-lr", type=float, default=1.0)
    parser.add_argument("--eval-reps", type=int, default=2, help="central evaluations timed")
    parser.add_argument("--eval-batch", type=int, default=10_000)
    args = parser.parse_args(argv)
    if args.cpus:  # before torch starts its thread pools
        import os

        os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])

    import numpy as np
    import torch
    from torch import nn

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)  # noqa: NPY002 (pfl's samplers draw from numpy's global state)

    import pfl
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    with np.load(args.data) as z:
        x, y, users = z["x"], z["y"], z["users"]
        counts, test_x, test_y = z["counts"], z["test_x"], z["test_y"]
    t0 = time.perf_counter()
    images = x.astype(np.float32)
    mean = images.mean(axis=(0, 1, 2), dtype="float64")
    std = images.std(axis=(0, 1, 2), dtype="float64")
    images = ((images - mean) / std).astype(np.float32)
    tests = ((test_x.astype(np.float32) - mean) / std).astype(np.float32)
    labels = y.astype(np.int64).reshape(-1, 1)
    to_tensor = torch.as_tensor
    slices = {u: (to_tensor(images[users[u, :counts[u]]]), to_tensor(labels[users[u, :counts[u]]]))
              for u in range(len(users))}
    training = FederatedDataset.from_slices(slices, get_user_sampler("random", list(slices)))
    central = Dataset(raw_data=[to_tensor(tests),
                                to_tensor(test_y.astype(np.int64).reshape(-1, 1))])
    setup_s = time.perf_counter() - t0

    class ToChannelsFirst(nn.Module):
        def forward(self, inputs):
            return inputs.permute(0, 3, 1, 2)

    height = x.shape[1]
    flat = ((height - 4) // 2) ** 2 * 64
    net = nn.Sequential(
        ToChannelsFirst(), nn.Conv2d(x.shape[-1], 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3),
        nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten(), nn.Linear(flat, 128),
        nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 10))
    for layer in net.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(layer.weight)

    def cross_entropy(logits, targets, reduction):
        return nn.functional.cross_entropy(logits, targets.reshape(-1).long(),
                                           reduction=reduction)

    def loss(self, inputs, targets, eval=False):  # noqa: A002 (pfl's keyword)
        self.eval() if eval else self.train()
        return cross_entropy(self(inputs), targets, "mean")

    @torch.no_grad()
    def metrics(self, inputs, targets, eval=True):  # noqa: A002
        self.eval() if eval else self.train()
        logits = self(inputs)
        correct = (logits.argmax(-1) == targets.reshape(-1)).float().sum().item()
        return {"loss": Weighted(cross_entropy(logits, targets, "sum").item(), len(inputs)),
                "accuracy": Weighted(correct, len(inputs))}

    net.loss = types.MethodType(loss, net)
    net.metrics = types.MethodType(metrics, net)
    parameters = sum(p.numel() for p in net.parameters())
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(
                             [p for p in net.parameters() if p.requires_grad], args.central_lr))
    backend = SimulatedBackend(training_data=training, val_data=None,
                               postprocessors=[WeightByUser()])

    eval_params = NNEvalHyperParams(local_batch_size=args.eval_batch)
    eval_s, eval_cpu_s, evaluation = [], [], None
    for _ in range(args.eval_reps):  # first: the time of an evaluation does not need training
        t0, cpu0 = time.perf_counter(), time.process_time()
        evaluation = model.evaluate(central, eval_params=eval_params)
        eval_s.append(time.perf_counter() - t0)
        eval_cpu_s.append(time.process_time() - cpu0)
    accuracy = next((float(v.overall_value) for k, v in evaluation
                     if str(k).endswith("accuracy")), None) if evaluation is not None else None
    report = {"pfl_version": getattr(pfl, "__version__", None),
              "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
              "parameters": parameters, "setup_s": setup_s, "eval_s": eval_s,
              "eval_cpu_s": eval_cpu_s,
              "test_accuracy_at_init": accuracy, "users": len(users), "iteration_s": []}
    ends: list[float] = []
    cpu_ends: list[float] = []

    class Clock(TrainingProcessCallback):
        """Records when each central iteration ends and prints what is measured so far (a
        run stopped midway keeps its iterations)."""

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
            report["iteration_s"] = [b - a for a, b in zip([started, *ends[:-1]], ends,
                                                           strict=True)]
            report["iteration_cpu_s"] = [b - a for a, b in zip([cpu_started, *cpu_ends[:-1]],
                                                               cpu_ends, strict=True)]
            print(json.dumps(report), flush=True)
            return False, Metrics()

    started, cpu_started = time.perf_counter(), time.process_time()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds,
                                           evaluation_frequency=args.rounds + 1,
                                           train_cohort_size=args.cohort, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=args.lr,
                                              local_num_epochs=args.epochs,
                                              local_batch_size=args.batch),
        model_eval_params=eval_params, callbacks=[Clock()])
    print(json.dumps({**report, "finished": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
