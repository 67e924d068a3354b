"""Greedy completions of two arithmetics that are both right, compared where exact tokens cannot be asked for:
the same tokens until a near-tie, and logprobs that agree wherever both saw the same text.

Each side's completion is a ``CompletionOutput`` asked for with ``logprobs`` (its top candidates per token)."""
from __future__ import annotations


def first_difference(ref, out) -> int | None:
    """The first position where the two greedy completions differ; None where they agree throughout."""
    return next((i for i, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b), None)


def logprob_differences(refs, outs) -> list[float]:
    """|ref - out| of every token both list, at every position where the two saw the same text (up to and
    including a parting: the text before it is the same)."""
    diffs = []
    for ref, out in zip(refs, outs):
        parting = first_difference(ref, out)
        for j in range(len(ref.token_ids) if parting is None else parting + 1):
            diffs += [abs(ref.logprobs[j][t].logprob - out.logprobs[j][t].logprob)
                      for t in ref.logprobs[j].keys() & out.logprobs[j].keys()]
    return diffs


def parting_problems(refs, outs, bound: float) -> list[str]:
    """Where a completion parts from the reference (the same text before it, so the same question asked of
    both), each side's token must be a near-tie seen from both sides: in both top lists, and within ``bound``
    nats of the other side's choice under both distributions. A wrong cache read diverges at once to a token
    the reference finds far less likely (outside its top few of 49,152, or many nats behind)."""
    problems = []
    for p, (ref, out) in enumerate(zip(refs, outs)):
        i = first_difference(ref, out)
        if i is None:
            continue
        a, b = ref.token_ids[i], out.token_ids[i]
        ref_lp, out_lp = ref.logprobs[i], out.logprobs[i]
        if b not in ref_lp or a not in out_lp:
            problems.append(f"prompt {p} token {i}: {b} not in the reference's top {len(ref_lp)} or {a} not in "
                            "its own")
            continue
        gaps = (ref_lp[a].logprob - ref_lp[b].logprob, out_lp[b].logprob - out_lp[a].logprob)
        print(f"  prompt {p} parts at token {i}: {gaps[0]:.4f} nats behind the reference's choice, "
              f"{gaps[1]:.4f} ahead in its own")
        if max(gaps) > bound:
            problems.append(f"prompt {p} token {i}: gaps {gaps} beyond {bound:.4f} nats")
    return problems
