"""The ``dropless`` command: ``dropless train`` trains a small MoE language model out of the box,
``dropless generate`` samples text from its checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from dropless.quantized import GEMM_RECIPES
from dropless.train.errors import TrainError
from dropless.train.model import parameter_counts
from dropless.train.presets import PRESETS, Preset

_TRAIN_DESCRIPTION = """\
Train a byte-level, Mixtral-style MoE language model (RMSNorm, rotary attention, the dropless MoE as
every FFN) on the Python standard library's own source, or on your text with --data. On a GPU the
MoE runs dropless' Triton kernels under bf16 autocast; on the CPU, the PyTorch reference.

Several processes train data-parallel: torchrun --nproc-per-node N -m dropless train ...

Writes to --out: checkpoint.safetensors, loss.png, expert-load.png and summary.json."""



def _describe(preset: Preset) -> str:
    """One line of the help: the preset's model and its step."""
    m, t = preset.model, preset.train
    total, active, _ = parameter_counts(m)
    return (f"  {preset.name:<7} {m.n_layers} layers, d_model {m.d_model}, {m.num_experts} experts top-{m.top_k} "
            f"(d_ff {m.d_ff}): {total / 1e6:.1f}M parameters, {active / 1e6:.1f}M active;\n"
            f"          {t.steps} steps of {t.batch_size} x {t.seq_len} bytes; {preset.description}")


_TRAIN_EPILOG = "presets:\n" + "\n".join(_describe(p) for p in PRESETS.values())


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _learning_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _make_out_dir(path: Path) -> None:
    """Create ``--out`` (and its parents) before training, so a folder that cannot hold the results is
    reported now, in one line, rather than as a traceback when the first file is written."""
    if path.exists() and not path.is_dir():
        raise TrainError(f"--out {path}: is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrainError(f"--out {path}: cannot create the folder ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise TrainError(f"--out {path}: cannot write in the folder")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dropless", description="Train a small MoE language model out of the "
                                     "box (dropless train) and sample text from it (dropless generate).")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a small MoE language model", description=_TRAIN_DESCRIPTION,
                           epilog=_TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--preset", choices=list(PRESETS), help="model and training setup (default: tiny on the "
                       "CPU, small on a GPU)")
    train.add_argument("--data", type=Path, metavar="FILE",
                       help="train on this text file (default: the Python standard library's source)")
    train.add_argument("--out", type=Path, metavar="DIR", help="folder for the checkpoint, plots and summary "
                       "(default: runs/PRESET)")
    train.add_argument("--resume", action="store_true",
                       help="continue from DIR/checkpoint.safetensors, exactly where it stopped")
    train.add_argument("--steps", type=_positive, help="optimizer steps (the length of the cosine schedule)")
    train.add_argument("--batch-size", type=_positive, help="sequences per step and per process")
    train.add_argument("--seq-len", type=_positive, help="tokens (bytes) per sequence")
    train.add_argument("--lr", type=_learning_rate, help="peak learning rate")
    train.add_argument("--seed", type=int, help="seed of the initialization and of the batches")
    train.add_argument("--expert-bias", action="store_true",
                       help="add DeepSeek-V3's auxiliary-loss-free balancing (a routing bias nudged every step)")
    train.add_argument("--recompute-activation", action="store_true",
                       help="save less for the backward: the experts' SwiGLU output is computed again there")
    train.add_argument("--fp8", choices=GEMM_RECIPES, help="run the experts' GEMMs in FP8 with this recipe "
                       "(on a GPU with FP8 tensor cores: H100, L4, ...; the CPU runs the same numerics)")
    train.add_argument("--ep", type=_positive, default=1,
                       help="expert parallelism: shard each MoE layer's experts over groups of this many "
                            "processes (under torchrun; default: %(default)s, every process holds every expert)")
    train.add_argument("--ep-backend", choices=("nccl", "symmetric_memory"), default="nccl",
                       help="how --ep moves the tokens: nccl (all_to_all_single, one host sync a layer) or "
                            "symmetric_memory (no host sync; buffers sized for the most a rank can receive) "
                            "(default: %(default)s)")
    train.add_argument("--device", default="auto", help="auto (the GPU if there is one), cpu or cuda")
    train.add_argument("--compile", action="store_true", help="torch.compile the model")
    train.add_argument("--cuda-graph", action="store_true",
                       help="capture the whole training step in a CUDA graph after 3 eager steps and replay it "
                            "(one GPU, one process; with --compile, the compiled step is captured)")
    train.set_defaults(handler=_train)

    generate = sub.add_parser("generate", help="sample text from a checkpoint of dropless train",
                              description="Continue a prompt with a model trained by dropless train.")
    generate.add_argument("checkpoint", type=Path, help="a checkpoint.safetensors written by dropless train")
    generate.add_argument("--prompt", default="", help="text to continue (default: start from a newline)")
    generate.add_argument("--tokens", type=_positive, default=300, help="bytes to generate (default: %(default)s)")
    generate.add_argument("--temperature", type=float, default=0.8,
                          help="softmax temperature; 0 takes the likeliest byte (default: %(default)s)")
    generate.add_argument("--top-k", type=_positive, default=40,
                          help="sample among the k likeliest bytes (default: %(default)s)")
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: %(default)s)")
    generate.add_argument("--device", default="auto", help="auto (the GPU if there is one), cpu or cuda")
    generate.set_defaults(handler=_generate)
    return parser


def _train(args: argparse.Namespace) -> int:
    import torch

    from dropless.train import distributed
    from dropless.train.data import load_corpus
    from dropless.train.loop import Trainer
    from dropless.train.memory import check_fits
    from dropless.train.report import format_summary

    ranks = distributed.ranks_from_environment()
    device = distributed.resolve_device(args.device, ranks)
    preset = PRESETS[args.preset or ("small" if device.type == "cuda" else "tiny")]
    model_config = dataclasses.replace(preset.model, expert_bias=args.expert_bias or preset.model.expert_bias,
                                       recompute_activation=args.recompute_activation
                                       or preset.model.recompute_activation,
                                       fp8=args.fp8 or preset.model.fp8)
    overrides = {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
                 "seed": args.seed}
    train_config = dataclasses.replace(preset.train, **{k: v for k, v in overrides.items() if v is not None})
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        check_fits(preset.name, model_config, train_config.batch_size, train_config.seq_len, free,
                   torch.cuda.get_device_name(device))
    corpus = load_corpus(args.data, train_config.seq_len)
    out_dir = args.out or Path("runs") / preset.name
    _make_out_dir(out_dir)
    distributed.start(ranks, device)
    try:
        trainer = Trainer(preset.name, model_config, train_config, corpus, out_dir, device, ranks,
                          resume=args.resume, compile=args.compile, ep=args.ep,
                          ep_backend=args.ep_backend, cuda_graph=args.cuda_graph)
        if ranks.is_main:
            print(trainer.describe(), flush=True)
        summary = trainer.run()
        distributed.wait_for_all()
    finally:
        distributed.stop()
    if ranks.is_main:
        print(format_summary(summary))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from dropless.train.checkpoint import load_model
    from dropless.train.distributed import Ranks, resolve_device
    from dropless.train.generate import generate_text

    model, checkpoint = load_model(args.checkpoint, resolve_device(args.device, Ranks()))
    context = checkpoint.meta["train_config"]["seq_len"]
    print(generate_text(model, args.prompt, args.tokens, context, args.temperature, args.top_k, args.seed))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dropless`` command with ``argv`` (default: the process's arguments); returns the exit
    status: 0, or 2 after printing the error of a bad input."""
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except TrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
