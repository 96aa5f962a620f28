"""Memory mappings a server's programs hold on a CPU, by kind of program.

XLA:CPU maps each compiled program's kernels into the process, and Linux caps a process's mappings
(``vm.max_map_count``, 65,530 by default): past the cap the next compile fails and the process dies. This
compiles a server's whole warm-up plan (``runtime.warmup``), shape by shape, for the embedded pair with a
serve config's engine settings (or another pair), and counts ``/proc/self/maps`` after each.

    JAX_PLATFORMS=cpu python bench/bench_mappings.py                    # configs/serve.yaml, the embedded pair
    JAX_PLATFORMS=cpu python bench/bench_mappings.py --target T --draft D --config my_serve.yaml
"""

from __future__ import annotations

import argparse
import collections

import timing
from dflash_jax import Engine, load_drafter, load_target
from dflash_jax.embedded import load_default
from dflash_jax.runtime.warmup import memory_mappings, run_warmup, sampling_flags, warmup_plan
from dflash_jax.serving.settings import load_serve_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/serve.yaml", help="the serve config whose engine settings to use")
    ap.add_argument("--target", help="target directory (default: the embedded pair)")
    ap.add_argument("--draft", help="drafter directory (default: the embedded pair's)")
    ap.add_argument("--out", help="JSON report")
    args = ap.parse_args()
    if memory_mappings() is None:
        raise SystemExit("no /proc/self/maps here: Linux only")
    cfg = load_serve_config(args.config)
    if args.target:
        target, drafter = load_target(args.target), (load_drafter(args.draft) if args.draft else None)
    else:
        target, drafter, _ = load_default()
    engine = Engine(target, drafter, cfg.engine)
    del target, drafter
    plan = warmup_plan(engine, sampling=sampling_flags(cfg.server.warmup_sampling, engine.config.max_logprobs))
    by_kind: dict[str, list[int]] = collections.defaultdict(list)
    for shape in plan:
        before = memory_mappings()[0]
        run_warmup(engine, [shape])
        by_kind[shape.phase].append(memory_mappings()[0] - before)
    used, cap = memory_mappings()
    print(f"{timing.device_line()}; {len(plan)} shapes of {args.config}'s plan")
    print("| program | count | mappings | per program |\n|---|---:|---:|---:|")
    for kind, counts in by_kind.items():
        print(f"| {kind} | {len(counts)} | {sum(counts)} | {sum(counts) / len(counts):.0f} |")
    print(f"the process holds {used} of the {cap} mappings Linux allows it")
    timing.write_json(args.out, dict(config=args.config, shapes=len(plan), used=used, cap=cap,
                                     by_kind={k: dict(count=len(v), mappings=sum(v)) for k, v in by_kind.items()}))


if __name__ == "__main__":
    main()
