"""`hacpo` command line. Subcommands import their heavy dependencies lazily."""
from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from .bandit_demo import run
    results = {}
    for algo in args.algorithms:
        results[algo] = run(algo, steps=args.steps, agents=args.agents, seed=args.seed)
    print("\nfinal expected accuracy per agent:")
    for algo, acc in results.items():
        print(f"  {algo:6s} " + "  ".join(f"{a:.3f}" for a in acc))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hacpo", description="Heterogeneous agent collaborative RL")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="seconds-long toy demo of the algorithm library (no LM)")
    d.add_argument("--algorithms", nargs="+", default=["gspo", "hacpo"])
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--agents", type=int, default=3)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_demo)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
