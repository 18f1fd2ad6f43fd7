"""``python -m benchmarks [ttft|store|vllm|vllm-ttft|quality|codecs|squad|oracle|probes|fuzz|drift|calibration|profile|hma|live-check|check-walk|tuning|readme|newcomer] [options]``;
no part runs them all but squad, oracle, probes, vllm-ttft, live-check, check-walk, tuning, readme and newcomer, which run only when named."""

import sys

from blend_integrations.engines.vllm_host import restart_on_tcmalloc

from . import (
    calibration,
    check_walk,
    codecs,
    drift,
    fuzz,
    hma,
    live_check,
    newcomer,
    oracle,
    pass_profile,
    probes,
    quality,
    readme,
    squad,
    store,
    ttft,
    tuning,
    vllm_bench,
    vllm_ttft,
)

PARTS = {
    "ttft": ttft.main,
    "store": store.main,
    "vllm": vllm_bench.main,
    "vllm-ttft": vllm_ttft.main,
    "quality": quality.main,
    "codecs": codecs.main,
    "squad": squad.main,
    "oracle": oracle.main,
    "probes": probes.main,
    "fuzz": fuzz.main,
    "drift": drift.main,
    "calibration": calibration.main,
    "profile": pass_profile.main,  # not benchmarks/profile.py: that would hide the standard library's profile
    "hma": hma.main,
    "live-check": live_check.main,
    "check-walk": check_walk.main,
    "tuning": tuning.main,
    "readme": readme.main,
    "newcomer": newcomer.main,
}


def main() -> None:  # vLLM starts processes: keep the entry under the __main__ guard below
    args = sys.argv[1:]
    # Every engine is timed on the malloc the vLLM engine gives its own
    # processes (glibc's page faults cost full prefill 6-11%): this process,
    # where the transformers engine runs, starts again with it preloaded.
    restart_on_tcmalloc("benchmarks", args)
    if args and args[0] in ("-h", "--help"):
        print(f"usage: python -m benchmarks [{'|'.join(PARTS)}] [options]")
        return
    if args and args[0] in PARTS:
        PARTS[args[0]](args[1:])
    elif args:
        sys.exit(f"unknown benchmark part {args[0]!r}; choose from: {', '.join(PARTS)}")
    else:  # every measurement; the oracle (hours on a 1.5B model), the probes (a 1.5B model's), tuning (it needs a tuned model), the
        # README's renderer, the newcomer's path, the long-prompt vLLM run (a GPU's), SQuAD, the live check's streams
        # (hours) and its walk (real 0.5B and 1.5B models) run only when named
        for name, part in PARTS.items():
            if name not in (
                "squad",
                "oracle",
                "probes",
                "vllm-ttft",
                "live-check",
                "check-walk",
                "tuning",
                "readme",
                "newcomer",
            ):
                part([])


if __name__ == "__main__":
    main()
