"""One sequence's position in its grammar: consume tokens, fill its row of the token bitmask, roll back, fork.

    m = grammar.new_matcher()
    m.fill_bitmask(bitmask, row)        # bitmask: int32 [R, ceil(V / 32)] on the host; bit t of row r = token t allowed
    m.accept(token)                     # False (and ``error`` set) if the grammar refuses it
    m.advance_to(seq_output_tokens)     # replay whatever it has not consumed yet (forks, rebuilt state)
    m.rollback(k); m.fork()             # speculative decoding; n > 1

Speculative decoding: a verifier that scores k draft tokens ``d1..dk`` in one forward needs k + 1 masks, one per
position: ``fill_draft_bitmasks([d1..dk], bitmask, row)`` fills rows ``row .. row + k`` (row + i: the mask after
d1..di), consuming the drafts the grammar accepts (checked first, so a refused one never puts the matcher in its
error state) and rolling them back afterwards, so the matcher
ends where it started. It returns how many drafts the grammar accepts: the rest are rejected whatever the model
says. After verification, ``accept`` the tokens that were kept (or ``rollback`` any consumed beyond them).
"""
from __future__ import annotations


class GrammarMatcher:
    """Wraps an ``llguidance.LLMatcher``; ``num_tokens`` counts the tokens it consumed."""

    def __init__(self, ll_matcher) -> None:
        self._m = ll_matcher
        self.num_tokens = 0

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and admits no further token (only EOS): the sequence is done."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What was consumed is a complete match (EOS is allowed now), though it may go on."""
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def accept(self, token_id: int) -> bool:
        ok = self._m.consume_token(token_id)
        if ok:
            self.num_tokens += 1
        return ok

    def advance_to(self, token_ids: list[int]) -> bool:
        """Consume ``token_ids[num_tokens:]`` (the sequence's output tokens); rolls back first when the sequence
        holds fewer tokens than were consumed. False when the grammar refuses one."""
        if len(token_ids) < self.num_tokens:
            self.rollback(self.num_tokens - len(token_ids))
        for token in token_ids[self.num_tokens:]:
            if not self.accept(token):
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens of a matcher that consumed {self.num_tokens}")
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar matcher failed to roll back {num_tokens} tokens: {self._m.get_error()}")
        self.num_tokens -= num_tokens

    def fork(self) -> "GrammarMatcher":
        child = GrammarMatcher(self._m.deep_copy())
        child.num_tokens = self.num_tokens
        return child

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write this matcher's allowed tokens into ``bitmask[row]`` (a contiguous int32 host tensor [R, W])."""
        width = bitmask.shape[1]
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * width * 4, width * 4)

    def fill_draft_bitmasks(self, draft_token_ids: list[int], bitmask, row: int) -> int:
        """Masks for a verifier of ``draft_token_ids``: rows ``row .. row + k`` (module docstring). Returns how many
        drafts the grammar accepts; rows past the first refused draft are left as they were."""
        accepted = self._m.validate_tokens(list(draft_token_ids)) if draft_token_ids else 0  # consumes nothing
        self.fill_bitmask(bitmask, row)
        for i, token in enumerate(draft_token_ids[:accepted]):
            if not self.accept(token):
                raise RuntimeError(f"grammar matcher refused draft token {token} it had validated: {self.error}")
            self.fill_bitmask(bitmask, row + i + 1)
        self.rollback(accepted)
        return accepted
