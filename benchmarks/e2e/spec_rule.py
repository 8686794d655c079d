"""The correctness rule of e2e.py --steps spec (spec_step.py): a speculative engine's greedy
output against the non-speculative engine of the same checkpoint, mode and graph form.

The engine does not repeat itself bit for bit (docs/e2e.md, *The engine's own variation*), so
the rule cannot be token identity. Instead: each token the speculative engine produced must be
the non-speculative engine's top-1 at that position, wherever that engine's top-1/top-2 margin
exceeds what its own run-to-run noise can move. The non-speculative engine (run_spec.py
--role plain) scores prompt + speculative output teacher-forced (prompt_logprobs=2: the top-2
and the given token at every position), twice in one process.

Noise (``noise_terms``), each the largest |difference| of one token's logprob at one position
between two runs of the non-speculative engine, over every token both runs report there:

* ``score_repeat``: the two scoring passes of the same sequences (prompt and output
  positions);
* ``generate_repeat``: its two greedy generations of the rule prompts, up to the first token
  where they differ (after it the contexts differ);
* ``decode_vs_score``: its own generation's decode-step logprobs against its teacher-forced
  scoring of that same output (the two paths a position can take through one engine; a
  verify step is neither).

``noise`` is the largest term. A top-1/top-2 margin moves by at most twice the noise when each
logprob moves by at most the noise, so a position is checked when its margin exceeds
``MARGIN_FACTOR`` x noise: there a different token cannot be the engine's own variation. A
checked position whose token is not the top-1 is a violation; the rule passes with none.
Also reported: mismatches at unchecked positions (explained by noise), and the stricter gap of
the given token itself (top-1 logprob minus the given token's, against the same threshold).

The control: the non-speculative engine's own greedy output judged by the same rule against
its own scoring (``control``); upstream's Hopper path judged the same way is the floor the
a100 mode is compared with (rows of variant "upstream").

Standard library only (the rows are computed where the results are gathered).
"""
from __future__ import annotations

import math

MARGIN_FACTOR = 2.0
FIRST_VIOLATIONS = 5   # violations listed in full per rule row
# A scored position: [top-1 token, its logprob, top-2 token, its logprob (None: not
# reported), given token, its logprob, its rank].
TOP1, LP1, TOP2, LP2, GIVEN, GIVEN_LP, GIVEN_RANK = range(7)
# A generated token's row (run_spec.py --role plain): [top-1, lp, top-2, lp, given lp].


def _lps(row, given_at: int | None, given_lp_at: int | None) -> dict:
    """token -> logprob of the tokens one row reports."""
    out = {row[TOP1]: row[LP1]}
    if row[TOP2] is not None and row[LP2] is not None:
        out[row[TOP2]] = row[LP2]
    if given_at is not None and row[given_lp_at] is not None:
        out[row[given_at]] = row[given_lp_at]
    return out


def row_diff(a, b, given_a=(GIVEN, GIVEN_LP), given_b=(GIVEN, GIVEN_LP)) -> float:
    """Largest |logprob difference| over the tokens two rows of one position both report."""
    la, lb = _lps(a, *given_a), _lps(b, *given_b)
    return max((abs(la[t] - lb[t]) for t in la.keys() & lb.keys()), default=0.0)


def score_repeat_noise(score: dict) -> float | None:
    """Two scoring passes of one set of sequences: output positions and the prompt noise the
    engine computed for the prompt positions (``prompt_noise``)."""
    runs = score.get("runs") or []
    if len(runs) < 2:
        return None
    d = 0.0
    for sa, sb in zip(runs[0], runs[1]):
        for a, b in zip(sa, sb):
            d = max(d, row_diff(a, b))
    return max([d, *[x for x in score.get("prompt_noise") or [] if x is not None]])


def generate_repeat_noise(gens: list) -> float | None:
    """Two greedy generations of the same prompts, compared up to the first differing token."""
    if len(gens) < 2:
        return None
    d = 0.0
    for ga, gb in zip(gens[0], gens[1]):
        for ta, tb, ra, rb in zip(ga["tokens"], gb["tokens"], ga["top"], gb["top"]):
            if ta != tb:
                break
            d = max(d, abs(ra[4] - rb[4]) if ra[4] is not None and rb[4] is not None else 0.0,
                    row_diff(ra, rb, (None, None), (None, None)))
    return d


def decode_vs_score_noise(gen: list, score: dict) -> float | None:
    """A generation's decode-step logprobs against the scoring of that same output."""
    runs = score.get("runs") or []
    if not gen or not runs:
        return None
    d = 0.0
    for g, rows in zip(gen, runs[0]):
        for tok, top, row in zip(g["tokens"], g["top"], rows):
            if row[GIVEN] != tok:
                return None   # not the same output
            gen_row = [top[0], top[1], top[2], top[3], tok, top[4], None]
            d = max(d, row_diff(gen_row, row))
    return d


def noise_terms(plain: dict) -> dict:
    """The three noise terms of a --role plain result (None where its data is missing)."""
    scores = plain.get("scores") or {}
    reps = [x for x in (score_repeat_noise(s) for s in scores.values()) if x is not None]
    gens = plain.get("generate") or []
    return dict(score_repeat=max(reps) if reps else None,
                generate_repeat=generate_repeat_noise(gens),
                decode_vs_score=decode_vs_score_noise(gens[0] if gens else [],
                                                      scores.get("plain") or {}))


def judge(outputs: list[list[int]], rows: list[list], threshold: float) -> dict:
    """Every output token against the scored rows of its position (one list per prompt)."""
    n = checked = mismatches = explained = 0
    violations, gap_violations, misaligned, outside_top2 = [], 0, 0, 0
    for p, (toks, srows) in enumerate(zip(outputs, rows)):
        if len(srows) != len(toks):
            misaligned += abs(len(srows) - len(toks))
        for j, (tok, r) in enumerate(zip(toks, srows)):
            n += 1
            if r[GIVEN] != tok:
                misaligned += 1
                continue
            margin = r[LP1] - r[LP2] if r[LP2] is not None else math.inf
            on = margin > threshold
            checked += on
            if tok == r[TOP1]:
                continue
            mismatches += 1
            outside_top2 += r[GIVEN_RANK] is not None and r[GIVEN_RANK] > 2
            gap_violations += r[GIVEN_LP] is not None and r[LP1] - r[GIVEN_LP] > threshold
            if on:
                violations.append(dict(prompt=p, position=j, token=tok, top1=r[TOP1],
                                       margin=margin, given_logprob=r[GIVEN_LP],
                                       given_rank=r[GIVEN_RANK]))
            else:
                explained += 1
    if len(rows) != len(outputs):
        misaligned += 1
    return dict(positions=n, positions_checked=checked, mismatches=mismatches,
                violations=len(violations), noise_explained_mismatches=explained,
                given_gap_violations=gap_violations, outside_top2=outside_top2,
                misaligned=misaligned, first_violations=violations[:FIRST_VIOLATIONS])


def _verdict(j: dict) -> bool:
    return j["violations"] == 0 and j["misaligned"] == 0 and j["positions"] > 0


def threshold_of(terms: dict) -> tuple[float | None, float | None]:
    """(noise, threshold) from noise_terms; None when no term was measured."""
    vals = [v for v in terms.values() if v is not None]
    if not vals:
        return None, None
    noise = max(vals)
    return noise, MARGIN_FACTOR * noise


def rule(spec: dict, plain: dict, label: str) -> dict:
    """The rule for one speculative result (its outputs) against the plain result that
    scored it under ``label``. ``passed`` is None when it cannot be judged (no scoring, or no
    noise measured), with ``reason``."""
    terms = noise_terms(plain)
    noise, threshold = threshold_of(terms)
    base = dict(noise=noise, noise_terms=terms, threshold=threshold, margin_factor=MARGIN_FACTOR)
    score = (plain.get("scores") or {}).get(label)
    if not score or not score.get("runs"):
        return dict(base, passed=None, reason=f"the plain engine did not score {label}")
    if noise is None:
        return dict(base, passed=None, reason="no run-to-run noise measured")
    if score.get("prompts_digest") != spec.get("prompts_digest"):
        return dict(base, passed=False, reason="scored other prompts than the speculative "
                    "engine served")
    j = judge(spec["outputs"], score["runs"][0], threshold)
    out = dict(base, passed=_verdict(j), **j)
    ctl = control(plain, threshold)
    out["control"] = ctl
    return out


def control(plain: dict, threshold: float | None = None) -> dict:
    """The plain engine's own greedy output under the same rule (its own scoring)."""
    gens, score = plain.get("generate") or [], (plain.get("scores") or {}).get("plain")
    if threshold is None:
        threshold = threshold_of(noise_terms(plain))[1]
    if not gens or not score or not score.get("runs") or threshold is None:
        return dict(passed=None, reason="no scored plain generation or no noise")
    j = judge([g["tokens"] for g in gens[0]], score["runs"][0], threshold)
    return dict(passed=_verdict(j), **{k: v for k, v in j.items() if k != "first_violations"},
                first_violations=j["first_violations"][:2])
