"""Columnar storage for the transfer dock: ragged per-owner sequences in paged flat numpy columns.

An owner (a dock row, or a group slot for prompts) holds `length[o]` values, stored in pages of
`page_size` slots of flat columns; `table[o, j]` is the page of its positions j*P .. j*P+P-1 (-1: none).
Appending allocates pages from a free list, freeing returns them: nothing ever moves or compacts, and
a page is rewritten only after its owner was freed. Every operation turns a batch of owners into
(start, length) chunks -- a few per owner -- and then one flat index, so numpy does the per-token work
and Python never loops over owners or tokens.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np


def exclusive_cumsum(lengths: np.ndarray) -> np.ndarray:
    """lengths[k] -> offsets[k]: where each of k consecutive segments starts in their concatenation."""
    out = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], out=out[1:])
    return out


def ragged_arange(starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """starts[k], lengths[k] -> concatenation of arange(starts[i], starts[i] + lengths[i]) over i.

    out: an int64 buffer at least sum(lengths) long to fill (its prefix is returned); reusing one
    buffer saves fresh-page faults, which cost more than the arithmetic at millions of tokens.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    result = np.empty(total, dtype=np.int64) if out is None else out[:total]
    if total == 0:
        return result
    nonempty = lengths > 0
    starts, lengths = np.asarray(starts, dtype=np.int64)[nonempty], lengths[nonempty]
    # a running sum of ones that jumps to starts[i] where segment i begins
    jumps = starts.copy()
    jumps[1:] -= starts[:-1] + lengths[:-1] - 1
    result.fill(1)
    result[exclusive_cumsum(lengths)] = jumps
    np.cumsum(result, out=result)
    return result


def page_chunks(tables: np.ndarray, lo: np.ndarray, hi: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions lo[k] .. hi[k]-1 of k owners with page tables tables[k, pages] -> (chunk starts, lengths)
    in the flat columns, owner by owner, in position order."""
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    first = lo // page_size
    n_chunks = np.where(hi > lo, (hi - 1) // page_size - first + 1, 0)
    owner = np.repeat(np.arange(len(lo)), n_chunks)
    page_pos = ragged_arange(first[n_chunks > 0], n_chunks[n_chunks > 0])
    page_lo = page_pos * page_size
    a = np.maximum(lo[owner], page_lo)
    b = np.minimum(hi[owner], page_lo + page_size)
    return tables[owner, page_pos].astype(np.int64) * page_size + (a - page_lo), b - a


def split_flat(flat: np.ndarray, lengths: np.ndarray) -> list[list]:
    """flat[sum(lengths)], lengths[k] -> k Python lists (one tolist, then slices)."""
    values = flat.tolist()
    ends = np.cumsum(lengths).tolist()
    return [values[a:b] for a, b in zip(itertools.chain((0,), ends), ends)]


class PagedColumns:
    """Ragged values of `n_owners` owners (each at most max_len long) in paged flat columns."""

    def __init__(self, n_owners: int, max_len: int, dtypes: Mapping[str, np.dtype | type], page_size: int,
                 initial_pages: int | None = None):
        self.dtypes = {name: np.dtype(dt) for name, dt in dtypes.items()}
        self.page_size = int(page_size)
        self.max_len = int(max_len)
        self.length = np.zeros(n_owners, dtype=np.int64)
        self.table = np.full((n_owners, -(-self.max_len // self.page_size)), -1, dtype=np.int32)
        if initial_pages is None:  # np.zeros is lazily committed: only pages ever written become resident
            initial_pages = min(n_owners * self.table.shape[1], max(n_owners, (1 << 26) // self.page_size))
        pages = max(1, initial_pages)
        self.columns = {name: np.zeros(pages * self.page_size, dtype=dt) for name, dt in self.dtypes.items()}
        self.free_pages = np.arange(pages - 1, -1, -1, dtype=np.int32)  # a stack: the end is popped first
        self.n_free = pages
        self._index_buffer = np.zeros(0, dtype=np.int64)

    @property
    def n_pages(self) -> int:
        return len(self.free_pages)

    @property
    def nbytes(self) -> int:
        return sum(col.nbytes for col in self.columns.values()) + self.table.nbytes + self.free_pages.nbytes

    def _buffer(self, total: int) -> np.ndarray:
        if len(self._index_buffer) < total:
            self._index_buffer = np.zeros(max(total, 2 * len(self._index_buffer)), dtype=np.int64)
        return self._index_buffer

    def _grow(self, pages_needed: int) -> None:
        old = self.n_pages
        new = max(2 * old, old + pages_needed - self.n_free)
        for name, col in self.columns.items():
            grown = np.zeros(new * self.page_size, dtype=col.dtype)
            grown[:len(col)] = col
            self.columns[name] = grown
        stack = np.empty(new, dtype=np.int32)
        stack[:new - old] = np.arange(new - 1, old - 1, -1, dtype=np.int32)  # new pages go under the old free ones
        stack[new - old:new - old + self.n_free] = self.free_pages[:self.n_free]
        self.free_pages = stack
        self.n_free += new - old

    def index(self, owners: np.ndarray, lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> np.ndarray:
        """Flat column index of positions lo..hi-1 (default: all values) of owners[k], in that order.

        The result is a view of a buffer that the next call reuses: use it before calling again.
        """
        owners = np.asarray(owners, dtype=np.int64)
        lo = np.zeros(len(owners), dtype=np.int64) if lo is None else lo
        hi = self.length[owners] if hi is None else hi
        starts, lengths = page_chunks(self.table[owners], lo, hi, self.page_size)
        return ragged_arange(starts, lengths, self._buffer(int(lengths.sum())))

    def append(self, owners: np.ndarray, new_lengths: np.ndarray, values: Mapping[str, np.ndarray]) -> None:
        """Append values[c] (flat, new_lengths[k] each, in owner order) to distinct owners[k]."""
        owners = np.asarray(owners, dtype=np.int64)
        old = self.length[owners]
        new_end = old + np.asarray(new_lengths, dtype=np.int64)
        if (new_end > self.max_len).any():
            raise ValueError(f"PagedColumns: an owner would hold more than max_len={self.max_len} values")
        have, need = -(-old // self.page_size), -(-new_end // self.page_size)
        count = need - have
        total = int(count.sum())
        if total:
            if total > self.n_free:
                self._grow(total)
            pages = self.free_pages[self.n_free - total:self.n_free][::-1]
            self.n_free -= total
            self.table[np.repeat(owners, count), ragged_arange(have, count)] = pages
        idx = self.index(owners, old, new_end)
        for name, col in self.columns.items():
            col[idx] = values[name]  # a scalar broadcasts
        self.length[owners] = new_end

    def free(self, owners: np.ndarray) -> None:
        owners = np.asarray(owners, dtype=np.int64)
        held = self.table[owners]
        pages = held[held >= 0]
        self.free_pages[self.n_free:self.n_free + len(pages)] = pages
        self.n_free += len(pages)
        self.table[owners] = -1
        self.length[owners] = 0

    def gather(self, owners: np.ndarray, column: str) -> np.ndarray:
        """Concatenated values of owners[k] (repeats allowed), in that order."""
        return np.take(self.columns[column], self.index(owners))

    def export(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """-> (length[n_owners], {column: every owner's values concatenated in owner order})."""
        idx = self.index(np.arange(len(self.length)))
        return self.length.copy(), {name: np.take(col, idx) for name, col in self.columns.items()}

    def load(self, lengths: np.ndarray, flats: Mapping[str, np.ndarray]) -> None:
        """Fill an empty store from export() output."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.shape != self.length.shape or (lengths < 0).any() or (lengths > self.max_len).any():
            raise ValueError(f"dock snapshot: lengths of shape {lengths.shape} (or values) do not fit "
                             f"{len(self.length)} owners of at most {self.max_len}")
        total = int(lengths.sum())
        for name in self.dtypes:
            if np.shape(flats[name]) != (total,):
                raise ValueError(f"dock snapshot: column {name} has shape {np.shape(flats[name])}; "
                                 f"lengths say ({total},)")
        self.append(np.arange(len(lengths)), lengths, {name: np.asarray(flats[name]) for name in self.dtypes})


class TokenRows(Sequence):
    """Prompt + response token ids of k rows, read lazily from the dock's pages.

    Item i is a list[int] built on access (what an HTTP request body needs); `flat()` gives all rows
    as one int32 array. Valid while the rows are in flight: their pages are not rewritten until freed.
    """

    def __init__(self, prompts: PagedColumns, slots: np.ndarray, responses: PagedColumns, rows: np.ndarray):
        self._p_col, self._p_size = prompts.columns["tokens"], prompts.page_size
        self._r_col, self._r_size = responses.columns["tokens"], responses.page_size
        self._p_table, self._r_table = prompts.table[slots], responses.table[rows]
        self.prompt_lengths = prompts.length[slots]
        self.response_lengths = responses.length[rows]
        self.lengths = self.prompt_lengths + self.response_lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def _pieces(self, col, table_row, length: int, size: int) -> list[np.ndarray]:
        return [col[page * size: page * size + min(size, length - j * size)]
                for j, page in enumerate(table_row[:-(-length // size)].tolist())]

    def array(self, i: int) -> np.ndarray:
        """Row i as an int32 array."""
        pieces = self._pieces(self._p_col, self._p_table[i], int(self.prompt_lengths[i]), self._p_size)
        pieces += self._pieces(self._r_col, self._r_table[i], int(self.response_lengths[i]), self._r_size)
        return np.concatenate(pieces)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"TokenRows: index {i} out of range for {len(self)} rows")
        return self.array(i % len(self)).tolist()

    def __iter__(self):  # all rows at once: one gather, one tolist (per-row access costs ~30 us a row)
        return iter(self.to_lists())

    def flat(self) -> np.ndarray:
        """All rows concatenated (int32[sum(lengths)]), row by row."""
        out = np.empty(int(self.lengths.sum()), dtype=np.int32)
        offsets = exclusive_cumsum(self.lengths)
        zeros = np.zeros(len(self), dtype=np.int64)
        out[ragged_arange(offsets, self.prompt_lengths)] = self._p_col[
            ragged_arange(*page_chunks(self._p_table, zeros, self.prompt_lengths, self._p_size))]
        out[ragged_arange(offsets + self.prompt_lengths, self.response_lengths)] = self._r_col[
            ragged_arange(*page_chunks(self._r_table, zeros, self.response_lengths, self._r_size))]
        return out

    def to_lists(self) -> list[list[int]]:
        return split_flat(self.flat(), self.lengths)

    def __reduce__(self):  # pickled (e.g. sent to a Ray actor) as plain lists, never the dock's whole columns
        return (list, (self.to_lists(),))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and self.to_lists() == [list(x) for x in other]

    def __repr__(self) -> str:
        return f"TokenRows({len(self)} rows, {int(self.lengths.sum())} tokens)"
