"""Calibration, journal: every reply a calibration measures, appended to a file
as it comes (``calibrate(journal=...)``), so that a calibration stopped midway
(a session's end, a crash) resumes where it stopped instead of starting over:
on a CPU a 1.5B model's calibration takes hours.

One JSON line per reply, keyed by what produced it (the probe's tokens and
chunks, the mode, ratio and settings). The first line names what the replies
are valid for: the model's checkpoint, dtype, engine and codec, what each
reply holds, and the CPU (the replies' times are compared with each other,
so a journal from another machine is not mixed in). A journal that names
anything else is started afresh; a line that does not read back whole (cut
by a kill) or holds a value out of range is measured again, never used.

A reply's guard shares are kept at the ladder's rungs alone (the ladder is part
of what a journal is valid for): calibration reads a share nowhere else, and a
whole ranking (a float per reused token) made a 1.5B model's journal 14 MB
compressed, too much to commit between sessions."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..prompt import TokenizedPrompt
from .records import RankShares

logger = logging.getLogger(__name__.rsplit(".", 1)[0])

JOURNAL_VERSION = 2  # 2: shares at the ladder's rungs


def cpu_name() -> str:
    """The CPU: its model name, the vector extensions vLLM's and torch's CPU kernels depend on
    (bfloat16 is computed natively or emulated by them, and its results differ), its family
    and model, and how many CPUs this process may use. A journal's replies are valid on one."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    fields: dict[str, str] = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first CPU's
    flags = fields.get("flags", "").split()
    ext: list[str] = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2") if f in flags]
    if "cpu family" in fields:
        ext.append(f"family {fields['cpu family']} model {fields.get('model', '?')}")
    name = fields.get("model name", os.uname().machine)
    return f"{name} ({', '.join(ext) or 'no AVX2'}), {len(os.sched_getaffinity(0))} CPUs"


@dataclass
class KeptReply:
    """A reply read back from a journal: what calibration reads of a generation (``measure.Reply``)."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    ttft_s: float
    ranking_share: Callable[[float], float] | None  # a RungShares
    wall_s: float = 0.0  # how long measuring it took (the calibration's time, summed over its pieces)


@dataclass(frozen=True)
class RungShares:
    """A reply's guard shares (``RankShares``) as the journal keeps them: at the ladder's rungs."""

    at: dict[float, float]

    def __call__(self, r: float) -> float:
        if r not in self.at:
            raise ValueError(f"the journal kept shares at the ladder's rungs {sorted(self.at)}, not at {r}")
        return self.at[r]


class Journal:
    """The replies one calibration measured on ``ladder`` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, identity: dict[str, Any], ladder: Sequence[float]) -> None:
        self.path = Path(path)
        self.ladder = tuple(ladder)
        identity = identity | {"ladder": list(self.ladder)}
        self.header = {"journal": "blend-calibration", "version": JOURNAL_VERSION, "identity": identity}
        self.replies: dict[str, KeptReply] = {}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        dropped = self._read()
        if dropped:
            logger.warning(
                "calibration journal %s: %d line(s) did not read back whole; measuring them again", path, dropped
            )
        if self.replies:
            logger.info("calibration journal %s: resuming with %d replies measured before", path, len(self.replies))

    def _read(self) -> int:
        """Read the replies a journal for this identity holds; start it afresh where it is another's."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            text = ""
        lines = text.splitlines()
        try:
            header = json.loads(lines[0]) if lines else None
        except ValueError:
            header = None
        if header != self.header:
            if lines:
                logger.warning(
                    "calibration journal %s was written for another model, engine, CPU or version: starting it afresh",
                    self.path,
                )
            self.path.write_text(json.dumps(self.header) + "\n")
            return 0
        if not text.endswith("\n"):  # its last line was cut: the next reply starts a line of its own
            with open(self.path, "a") as f:
                f.write("\n")
        dropped = 0
        for line in lines[1:]:
            try:
                entry = json.loads(line)
                self.replies[_check_key(entry["key"])] = _reply(entry, self.ladder)
            except (ValueError, TypeError, KeyError):
                dropped += 1
        return dropped

    @staticmethod
    def key(prompt: TokenizedPrompt, mode: str, ratio: float | None = None, settings: dict | None = None) -> str:
        what = [list(prompt.token_ids), [list(s) for s in prompt.chunk_spans], prompt.question_end, mode, ratio]
        what.append(settings)
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()

    def get(self, key: str) -> KeptReply | None:
        return self.replies.get(key)

    def put(self, key: str, reply: Any, wall_s: float = 0.0) -> None:
        """Append ``reply`` (a generation), measured in ``wall_s`` seconds; one whose guard shares
        cannot be written is not kept."""
        shares = reply.ranking_share
        if shares is not None and not isinstance(shares, RankShares):
            return
        entry = {
            "key": key,
            "token_ids": list(reply.token_ids),
            # the first step's alone: calibration reads only the first token's (its KL), and the journal
            # of a 1.5B model's calibration is committed between sessions (``benchmarks calibration --checkpoint``)
            "logprobs": None if reply.logprobs is None else [sorted(step.items()) for step in reply.logprobs[:1]],
            "ttft_s": reply.ttft_s,
            "shares": None if shares is None else [shares(r) for r in self.ladder],
            "wall_s": round(float(wall_s), 4),
        }
        try:
            kept = _reply(json.loads(json.dumps(entry)), self.ladder)  # what a resumed run would read
        except (ValueError, TypeError):
            return  # a value a resumed run would refuse (an infinite log-probability): measured again then
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        self.replies[key] = kept


def _check_key(key: Any) -> str:
    if not isinstance(key, str) or len(key) != 64:
        raise ValueError("key")
    return key


def _reply(entry: dict, ladder: tuple[float, ...]) -> KeptReply:
    """A journal line's reply, every value checked (ValueError/TypeError when one is out of range)."""
    token_ids, logprobs, ttft, shares = (entry[k] for k in ("token_ids", "logprobs", "ttft_s", "shares"))
    if not isinstance(token_ids, list) or not all(isinstance(t, int) and t >= 0 for t in token_ids):
        raise ValueError("token_ids")
    if not isinstance(ttft, float) or not (math.isfinite(ttft) and ttft > 0):
        raise ValueError("ttft_s")
    steps = None
    if logprobs is not None:
        steps = [{int(t): float(lp) for t, lp in step} for step in logprobs]
        if any(not math.isfinite(lp) or lp > 1e-6 for step in steps for lp in step.values()):
            raise ValueError("logprobs")
    if shares is not None:
        at_rungs = [float(s) for s in shares]
        if len(at_rungs) != len(ladder) or any(not 0.0 <= s <= 1.0 + 1e-6 for s in at_rungs):
            raise ValueError("shares")
        if at_rungs != sorted(at_rungs):  # the top share of more tokens never holds less
            raise ValueError("shares")
    wall = entry.get("wall_s", 0.0)  # absent from the lines of the journals before it
    if not isinstance(wall, (int, float)) or not (math.isfinite(wall) and wall >= 0):
        raise ValueError("wall_s")
    kept = None if shares is None else RungShares(dict(zip(ladder, at_rungs)))
    return KeptReply(token_ids, steps, ttft, kept, float(wall))
