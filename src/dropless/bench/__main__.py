"""``python -m dropless.bench gemm | fp8 | moe | ep | jax | merge | readme``: run the GEMM benchmark, its FP8
version, the whole MoE layer benchmark, the expert-parallel one (under ``torchrun``) or the JAX one, join
result files of runs split by shape, or regenerate the README tables."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from dropless.bench import ep_report, fp8_report, moe_report
from dropless.bench.environment import device_name, slug
from dropless.bench.fp8 import Fp8Options, format_fp8_table, format_quantization_table, run_fp8
from dropless.bench.fp8_peers import FP8_METHODS
from dropless.bench.gemm import GemmOptions, run_gemm
from dropless.bench.jax_report import LABELS as JAX_LABELS
from dropless.bench.jax_report import PASSES as JAX_PASSES
from dropless.bench.jax_report import format_jax_table
from dropless.bench.merge import merge_results
from dropless.bench.moe import BF16_METHODS, MoEOptions, run_moe
from dropless.bench.moe import METHODS as MOE_METHODS
from dropless.bench.moe_layers import CONFIGS as MOE_CONFIGS
from dropless.bench.options import FULL_TIMING, QUICK_TIMING, ROUNDS, RunOptions
from dropless.bench.peers import METHODS
from dropless.bench.plot import plot
from dropless.bench.problem import PASSES
from dropless.bench.readme import END, START, render, update_readme
from dropless.bench.report import format_summary, format_table, read_json, write_json
from dropless.bench.routing import ALL_ROUTINGS
from dropless.bench.shapes import GROUPS
from dropless.quantized import GEMM_RECIPES

RESULTS = Path("benchmarks/results")
SHAPES_HELP = (f"shape names or group names, of {list(GROUPS)} (default: the training group; "
               "decode: at most 16 rows per expert)")
ROUTING_HELP = (f"of {list(ALL_ROUTINGS)} (default: each shape's own: balanced and skewed, and all-to-one too "
                "for the decode shapes)")


def _names(values: Sequence[str] | None) -> list[str] | None:
    """``--x a b`` and ``--x a,b`` alike."""
    if values is None:
        return None
    return [v for value in values for v in value.split(",") if v]


def _add_run_arguments(parser: argparse.ArgumentParser, kind: str, tiny: str) -> argparse.ArgumentParser:
    """The arguments every benchmark run takes: output, timing, seed, commit."""
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG (default: %(default)s)")
    parser.add_argument("--name", help=f"result file stem (default: {kind}-<device>, {kind}-quick-<device> with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{tiny} and short timing: a smoke run of seconds, on the CPU too")
    parser.add_argument("--warmup", type=float,
                        help=f"warm-up per timed case, ms (default: {FULL_TIMING[0]:g}, quick: {QUICK_TIMING[0]:g})")
    parser.add_argument("--rep", type=float,
                        help=f"timed repetitions per case, ms (default: {FULL_TIMING[1]:g}, quick: {QUICK_TIMING[1]:g})")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="timing rounds; each case reports the median of its rounds (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the routing, the weights and the operands")
    parser.add_argument("--commit", help="commit to record, for a copy of the code outside git (default: from git)")
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dropless.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gemm = _add_run_arguments(sub.add_parser(
        "gemm", help="time the grouped GEMM against its peers on the same inputs"), "gemm", "tiny shapes")
    gemm.add_argument("--shapes", nargs="+", help=SHAPES_HELP)
    gemm.add_argument("--routing", nargs="+", help=ROUTING_HELP)
    gemm.add_argument("--passes", nargs="+", help=f"of {list(PASSES)} (default: all)")
    gemm.add_argument("--methods", nargs="+", help=f"of {list(METHODS)} (default: all)")

    fp8 = _add_run_arguments(sub.add_parser(
        "fp8", help="time the FP8 grouped GEMMs (every recipe, weights cached or quantized in the call) against "
                    "dropless BF16, torchao, torch._scaled_grouped_mm and a dense FP8 ceiling"), "fp8", "tiny shapes")
    fp8.add_argument("--shapes", nargs="+", help=SHAPES_HELP)
    fp8.add_argument("--routing", nargs="+", help=ROUTING_HELP)
    fp8.add_argument("--passes", nargs="+", help=f"of {list(PASSES)} (default: all)")
    fp8.add_argument("--methods", nargs="+", help=f"of {list(FP8_METHODS)} (default: all)")
    fp8.add_argument("--quantization", choices=("all", "activations", "none"), default="all",
                     help="quantization kernels to time on their own: all, the activations of the shapes run "
                          "(for all but one of the runs split by shape), or none (default: %(default)s)")

    moe = _add_run_arguments(sub.add_parser(
        "moe", help="time the whole MoE layer (fwd+bwd) of dropless, a torch._grouped_mm layer and "
                    "transformers' blocks on the same weights"), "moe", "tiny layers")
    moe.add_argument("--configs", nargs="+", help=f"of {[c.name for c in MOE_CONFIGS]} (default: all)")
    moe.add_argument("--methods", nargs="+", help=f"of {list(MOE_METHODS)} (default: the BF16 ones)")
    moe.add_argument("--fp8", nargs="+", default=(), choices=GEMM_RECIPES, metavar="RECIPE",
                     help=f"also run dropless.MoE with FP8 expert GEMMs in these recipes, of {list(GEMM_RECIPES)}")

    ep = _add_run_arguments(sub.add_parser(
        "ep", help="expert parallelism, run as torchrun --nproc-per-node P -m dropless.bench ep: dispatch and "
                   "combine GB/s per rank against NCCL all_to_all_single with and without its count exchange, "
                   "and the EP MoE layer's fwd+bwd against the same per-GPU work on one GPU; rank 0 writes "
                   "ep-<device>-x<P>.json"), "ep", "tiny cases on gloo CPU processes (or GPUs)")
    ep.add_argument("--cases", nargs="+", help="exchange cases, of deepep, mixtral (default: both)")
    ep.add_argument("--configs", nargs="+", help="layer configs, of dsv3 (default: all)")
    ep.add_argument("--routing", nargs="+", default=["balanced"],
                    help="of balanced, skewed (default: %(default)s; the bars are judged on balanced)")
    ep.add_argument("--parts", nargs="+", default=["exchange", "layer"], help="of exchange, layer (default: both)")
    ep.add_argument("--backends", nargs="+",
                    help="dispatch backends to try, each a method dropless_<backend> where dispatch accepts it "
                         "(default: nccl, symmetric_memory)")
    ep.add_argument("--fp8", action="store_true", help="also time dispatch with the rowwise FP8 recipe")
    ep.add_argument("--recipes", nargs="+", default=["bf16", "rowwise"],
                    help="the layer's expert GEMMs: bf16 and/or rowwise (FP8) (default: both)")
    ep.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cuda: one GPU per rank over NCCL; cpu: gloo (default: cuda when there is one)")

    jax_bench = _add_run_arguments(sub.add_parser(
        "jax", help="time dropless.jax.ragged_dot against jax.lax.ragged_dot, the PyTorch dropless.grouped_mm "
                    "and a dense jnp matmul in one process; JAX's GPU memory grows on demand "
                    "(XLA_PYTHON_CLIENT_PREALLOCATE=false unless set) so the PyTorch side keeps its share"),
        "jax", "tiny shapes")
    jax_bench.add_argument("--shapes", nargs="+", help=SHAPES_HELP)
    jax_bench.add_argument("--routing", nargs="+", help=ROUTING_HELP)
    jax_bench.add_argument("--passes", nargs="+", help=f"of {list(JAX_PASSES)} (default: both)")
    jax_bench.add_argument("--methods", nargs="+", help=f"of {list(JAX_LABELS)} (default: all)")

    jax_train = sub.add_parser(
        "jax-train", help="tokens/s of a jitted training step of the JAX MoE language model against the PyTorch "
                          "step of dropless train at a preset's shape, in one process, on the same data")
    jax_train.add_argument("--preset", help="the model and batch shape (default: small, tiny with --quick)")
    jax_train.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's; quick: 4)")
    jax_train.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's; quick: 64)")
    jax_train.add_argument("--steps", type=int, help="timed steps per method and round (default: 20, quick: 2)")
    jax_train.add_argument("--warmup-steps", type=int,
                           help="untimed steps after the first (compilation, tuning) (default: 5, quick: 1)")
    jax_train.add_argument("--rounds", type=int, help="timing rounds; each method reports the median (default: 3, "
                                                      "quick: 1)")
    jax_train.add_argument("--methods", nargs="+", help="of dropless_jax, dropless (default: both)")
    jax_train.add_argument("--attention", choices=("xla", "cudnn"),
                           help="the JAX model's attention (default: cuDNN's fused attention where it compiles)")
    jax_train.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG (default: %(default)s)")
    jax_train.add_argument("--name", help="result file stem (default: jax-train-<device>, jax-train-quick-<device> "
                                          "with --quick)")
    jax_train.add_argument("--quick", action="store_true", help="the tiny preset, a small batch and few steps: a "
                                                                "smoke run of seconds, on the CPU too")
    jax_train.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    jax_train.add_argument("--commit", help="commit to record, for a copy of the code outside git (default: from git)")

    merge = sub.add_parser("merge", help="join result files of runs split by shape into one")
    merge.add_argument("results", nargs="+", type=Path, help="result JSON files of disjoint shapes")
    merge.add_argument("--out", type=Path, required=True, help="the merged JSON file to write")
    merge.add_argument("--commit", help="commit of the code the runs ran (default: the first run's)")

    readme = sub.add_parser("readme", help=f"regenerate README.md's tables between {START} and {END} (GEMM), "
                                           f"{fp8_report.FP8_START} and {fp8_report.FP8_END} (FP8) and "
                                           f"{moe_report.MOE_START} and {moe_report.MOE_END} (MoE layer)")
    readme.add_argument("results", nargs="*", type=Path,
                        help=f"result JSON files (default: {RESULTS}/gemm-*.json, fp8-*.json and moe-*.json, "
                             "quick runs left out)")
    readme.add_argument("--readme", type=Path, default=Path("README.md"),
                        help="README to update (default: %(default)s)")
    return parser


def _run_options(args: argparse.Namespace) -> dict:
    """The ``RunOptions`` fields from the command line; quick runs default to short timing."""
    warmup, rep = QUICK_TIMING if args.quick else FULL_TIMING
    return dict(quick=args.quick, seed=args.seed, commit=args.commit, rounds=args.rounds,
                warmup=warmup if args.warmup is None else args.warmup, rep=rep if args.rep is None else args.rep)


def _run(args: argparse.Namespace, kind: str, run: Callable[[], dict], opts: RunOptions,
         plot_result: Callable[[dict, Path], bool], report: Callable[[dict], list[str]]) -> int:
    """Run a benchmark, write its JSON and PNG, print its report last."""
    name = args.name or f"{kind}-{'quick-' if args.quick else ''}{slug(device_name(opts.device))}"
    try:
        result = run()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    json_path, png_path = args.out / f"{name}.json", args.out / f"{name}.png"
    write_json(result, json_path)
    print(f"wrote {json_path}")
    print(f"wrote {png_path}" if plot_result(result, png_path) else "no plot: matplotlib is not installed")
    for text in report(result):
        print(text)
    return 0


def _gemm(args: argparse.Namespace) -> int:
    opts = GemmOptions(shapes=_names(args.shapes), routings=_names(args.routing),
                       passes=_names(args.passes) or PASSES, methods=_names(args.methods) or tuple(METHODS),
                       **_run_options(args))
    return _run(args, "gemm", lambda: run_gemm(opts), opts, plot,
                lambda result: [format_summary(result["rows"]), format_table(result)])


def _fp8(args: argparse.Namespace) -> int:
    opts = Fp8Options(shapes=_names(args.shapes), routings=_names(args.routing),
                      passes=_names(args.passes) or PASSES, methods=_names(args.methods) or tuple(FP8_METHODS),
                      quantization=args.quantization, **_run_options(args))
    return _run(args, "fp8", lambda: run_fp8(opts), opts, plot,
                lambda result: [format_quantization_table(result), format_fp8_table(result)])


def _moe(args: argparse.Namespace) -> int:
    opts = MoEOptions(configs=_names(args.configs), methods=_names(args.methods) or BF16_METHODS,
                      fp8=tuple(args.fp8), **_run_options(args))
    return _run(args, "moe", lambda: run_moe(opts), opts, moe_report.plot,
                lambda result: [moe_report.format_table(result)])


def _ep(args: argparse.Namespace) -> int:
    """Every rank runs the benchmark; rank 0 writes the files and prints the tables and bars last."""
    from dropless.bench.ep import EpOptions, process_group, run_ep
    from dropless.bench.ep_exchange import DISPATCH_BACKENDS

    opts = EpOptions(cases=_names(args.cases), configs=_names(args.configs), routings=_names(args.routing),
                     parts=_names(args.parts), backends=_names(args.backends) or DISPATCH_BACKENDS, fp8=args.fp8,
                     recipes=_names(args.recipes), **_run_options(args))
    with process_group(args.device) as ranks:
        opts.device = ranks.device
        try:
            result = run_ep(opts, ranks)
        except ValueError as exc:  # raised on every rank alike, before any collective
            if ranks.rank == 0:
                print(f"error: {exc}", file=sys.stderr)
            return 2
    if result is None:
        return 0
    name = args.name or f"ep-{'quick-' if args.quick else ''}{slug(result['meta']['gpu'])}-x{ranks.world}"
    json_path, png_path = args.out / f"{name}.json", args.out / f"{name}.png"
    write_json(result, json_path)
    print(f"wrote {json_path}")
    print(f"wrote {png_path}" if ep_report.plot(result, png_path) else "no plot: matplotlib is not installed")
    print(ep_report.format_tables(result))
    print(ep_report.format_bars(result))
    return 0


def _jax(args: argparse.Namespace) -> int:
    try:  # imported here: only this command loads JAX, and its module sets JAX's memory options first
        from dropless.bench.jax_gemm import JaxOptions, run_jax
    except ImportError as exc:
        print(f"error: the jax benchmark needs JAX ({exc})", file=sys.stderr)
        return 2
    opts = JaxOptions(shapes=_names(args.shapes), routings=_names(args.routing),
                      passes=_names(args.passes) or JAX_PASSES, methods=_names(args.methods) or tuple(JAX_LABELS),
                      **_run_options(args))
    return _run(args, "jax", lambda: run_jax(opts), opts,
                lambda result, path: plot(result, path, JAX_LABELS, "JAX grouped GEMM"),
                lambda result: [format_jax_table(result)])


def _jax_train(args: argparse.Namespace) -> int:
    try:  # imported here: only this command loads JAX, and its module sets JAX's memory options first
        from dropless.bench.jax_train import METHODS as TRAIN_METHODS
        from dropless.bench.jax_train import JaxTrainOptions, format_jax_train_table, run_jax_train
        from dropless.bench.jax_train import plot as plot_jax_train
    except ImportError as exc:
        print(f"error: the jax-train benchmark needs JAX, Flax and optax ({exc})", file=sys.stderr)
        return 2
    opts = JaxTrainOptions(preset=args.preset, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                           warmup_steps=args.warmup_steps, rounds=args.rounds,
                           methods=tuple(_names(args.methods) or TRAIN_METHODS), attention=args.attention,
                           quick=args.quick, seed=args.seed, commit=args.commit)
    return _run(args, "jax-train", lambda: run_jax_train(opts), opts, plot_jax_train,
                lambda result: [format_jax_train_table(result)])


def _merge(args: argparse.Namespace) -> int:
    try:
        result = merge_results([read_json(p) for p in args.results], args.commit)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_json(result, args.out)
    print(f"wrote {args.out} ({len(result['rows'])} rows from {len(args.results)} runs)")
    png_path = args.out.with_suffix(".png")
    print(f"wrote {png_path}" if plot(result, png_path) else "no plot: matplotlib is not installed")
    if "quantization" in result:
        print(format_quantization_table(result))
        print(format_fp8_table(result))
    else:
        print(format_summary(result["rows"]))
    return 0


def _readme(args: argparse.Namespace) -> int:
    # The training shapes' tables first, the decode shapes' after them.
    paths = args.results or [p for kind in ("gemm", "fp8", "moe")
                             for p in sorted(RESULTS.glob(f"{kind}-*.json"), key=lambda p: ("decode" in p.name, p.name))]
    try:
        results = [(p.name, read_json(p)) for p in paths]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.results:
        results = [(n, r) for n, r in results if not r["meta"].get("quick")]
    moe_results = [(n, r) for n, r in results if moe_report.is_moe_result(r)]
    fp8_results = [(n, r) for n, r in results if fp8_report.is_fp8_result(r)]
    results = [(n, r) for n, r in results if not moe_report.is_moe_result(r) and not fp8_report.is_fp8_result(r)]
    if not results and not moe_results and not fp8_results:
        print(f"error: no result files given and none in {RESULTS}", file=sys.stderr)
        return 2
    if results:
        block = render(results)
        if update_readme(args.readme, block):
            print(f"updated the performance table in {args.readme} from {', '.join(n for n, _ in results)}")
        else:
            print(block)
            print(f"\n{args.readme} has no {START} ... {END} markers (or does not exist): "
                  "the table is printed above and no file was changed", file=sys.stderr)
    if fp8_results:
        block = fp8_report.render(fp8_results)
        if update_readme(args.readme, block, fp8_report.FP8_START, fp8_report.FP8_END):
            print(f"updated the FP8 table in {args.readme} from {', '.join(n for n, _ in fp8_results)}")
        elif args.results:
            print(block)
            print(f"\n{args.readme} has no {fp8_report.FP8_START} ... {fp8_report.FP8_END} markers (or does not "
                  "exist): the FP8 table is printed above and no file was changed", file=sys.stderr)
    if moe_results:
        block = moe_report.render(moe_results)
        if moe_report.update_readme(args.readme, block):
            print(f"updated the MoE layer table in {args.readme} from {', '.join(n for n, _ in moe_results)}")
        elif args.results:  # asked for by name: show it; found by the default search: skip silently
            print(block)
            print(f"\n{args.readme} has no {moe_report.MOE_START} ... {moe_report.MOE_END} markers (or does not "
                  "exist): the MoE table is printed above and no file was changed", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"gemm": _gemm, "fp8": _fp8, "moe": _moe, "ep": _ep, "jax": _jax, "jax-train": _jax_train,
                "merge": _merge, "readme": _readme}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
