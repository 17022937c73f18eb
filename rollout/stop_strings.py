"""Stop strings across partial-rollout cuts.

SGLang (and the torch engine) match a request's stop strings in that request's own output only: after each step it
decodes the output's last (longest stop string + 1) tokens and looks for each string there. Two cases escape it:
- a string split by a partial-rollout cut, begun in the tokens a row carried over (the request's input) and ended in
  its continuation, is never seen, and the row would be continued past its end;
- an abort can return the token that completes a string before the check runs (finish_reason abort).
`completing_token` finds both from the row's tokens, so the driver can end the row where the engine would have.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]


def stop_window(stops: Sequence[str]) -> int:
    """Tokens enough to spell any stop string, plus one (a token spells at least one byte)."""
    return max(len(s.encode("utf-8")) for s in stops) + 1


def completing_token(before: Sequence[int], new: Sequence[int], stops: Sequence[str], decode: Decode) -> int | None:
    """before: the row's tokens ahead of this answer (only the last stop_window count, and only after any stop string
    already complete among them);
    new: the answer's tokens -> how many new tokens run up to and including the first one that completes a stop
    string the engine did not end on (split by the cut, or completed by an aborted answer's last token), else None."""
    if not new or not stops:
        return None
    window, new = stop_window(stops), list(new)
    before = list(before)[-window:]

    def holds(ids: list[int]) -> bool:
        return any(s in decode(ids) for s in stops)

    while before and holds(before):  # a string that ended there already (a tool call whose result was empty)
        before = before[1:]

    # a string begun before the cut ends within the first `window` new tokens (one that the new tokens hold alone
    # was the engine's to see)
    if before:
        for k in range(1, min(len(new), window) + 1):
            if holds(before + new[:k]) and not holds(new[:k]):
                return k
    # one completed by the last token, which an abort can return unchecked
    tail = (before + new)[-window:]
    return len(new) if holds(tail) and not holds(tail[:-1]) else None
