"""A KV cache with per-sequence lengths for ragged batched decoding with transformers models.

Rows are sequence slots. The cache never copies per round: a forward writes its new keys/values at
``positions`` (each row's own length + query offset), and rolling back rejected draft tokens is only a
change of the row's length. Rows used by one forward must be contiguous (``bind(rows, positions)``);
``RowTable`` keeps live sequences packed at the front by moving the last row into a freed one.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class RaggedLayer(CacheLayerMixin):
    """One decoder layer's keys/values, preallocated ``[rows, kv_heads, max_len, head_dim]``."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: RaggedKVCache, shape: tuple[int, int, int, int], dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.owner = owner
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.is_initialized = True
        self.device = self.keys.device

    def lazy_initialization(self, key_states, value_states) -> None:  # preallocated: nothing to do
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``key_states``/``value_states`` ``[n, kv_heads, Q, head_dim]`` at the bound positions and
        return the bound rows' keys/values up to the longest position, ``[n, kv_heads, kv_len, head_dim]``."""
        rows, positions, kv_len = self.owner.binding()
        row_index = torch.arange(positions.shape[0], device=positions.device)[:, None]  # [n, 1]
        keys, values = self.keys[rows], self.values[rows]  # views [n, kv_heads, max_len, head_dim]
        keys[row_index, :, positions] = key_states.transpose(1, 2).to(keys.dtype)
        values[row_index, :, positions] = value_states.transpose(1, 2).to(values.dtype)
        return keys[:, :, :kv_len], values[:, :, :kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.binding()[2], 0

    def get_seq_length(self) -> int:
        return int(self.owner.binding()[2])

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class RaggedKVCache(Cache):
    """KV cache for ``num_rows`` sequences of up to ``max_len`` tokens each (all layers).

    ``lengths[row]`` is the number of valid cached tokens of the sequence in ``row``; the owner updates it.
    """

    def __init__(self, num_layers: int, num_rows: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (num_rows, kv_heads, max_len, head_dim)
        super().__init__(layers=[RaggedLayer(self, shape, dtype, device) for _ in range(num_layers)])
        self.max_len = max_len
        self.num_rows = num_rows
        self.lengths = torch.zeros(num_rows, dtype=torch.long)
        self._binding: tuple[slice, torch.Tensor, int] | None = None

    @classmethod
    def for_model(cls, model, num_rows: int, max_len: int) -> RaggedKVCache:
        """Size a cache for ``model``; KV heads are read from the (possibly tensor-sharded) k_proj weight."""
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        first_attention = model.model.layers[0].self_attn
        kv_heads = first_attention.k_proj.weight.shape[0] // head_dim
        parameter = next(model.parameters())
        return cls(config.num_hidden_layers, num_rows, max_len, kv_heads, head_dim, parameter.dtype,
                   parameter.device)

    def bind(self, rows: slice, positions: torch.Tensor) -> None:
        """Bind the next forward to ``rows`` (contiguous) writing at ``positions`` ``[n, Q]``."""
        assert int(positions.max()) < self.max_len, "write past the cache end; check max_len"
        self._binding = (rows, positions, int(positions.max()) + 1)

    def binding(self) -> tuple[slice, torch.Tensor, int]:
        assert self._binding is not None, "RaggedKVCache used without bind()"
        return self._binding

    def move_row(self, source: int, destination: int) -> None:
        """Copy row ``source`` (keys, values and length) into row ``destination``."""
        length = int(self.lengths[source])
        for layer in self.layers:
            layer.keys[destination, :, :length] = layer.keys[source, :, :length]
            layer.values[destination, :, :length] = layer.values[source, :, :length]
        self.lengths[destination] = length

    def clear_row(self, row: int) -> None:
        """Zero a row's keys and values. Needed after non-finite values reached it: masked slots still enter
        attention as 0 × value, and 0 × NaN is NaN, so a stale NaN would poison the row's next tenant."""
        for layer in self.layers:
            layer.keys[row].zero_()
            layer.values[row].zero_()

    def attention_mask(self, rows: slice, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[n, 1, Q, kv_len]``: query (b, j) sees slot s iff s ≤ positions[b, j].

        Float (0 / −inf-like) so that both the sdpa and the eager attention read it correctly.
        """
        kv_len = int(positions.max()) + 1
        slots = torch.arange(kv_len, device=positions.device)
        allowed = slots[None, None, :] <= positions[:, :, None]  # [n, Q, kv_len]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[:, None]


class RowTable:
    """Maps sequence ids to packed cache rows ``0..len-1``; freeing a row moves the last one into it."""

    def __init__(self, cache: RaggedKVCache):
        self.cache = cache
        self.row_of: dict[str, int] = {}
        self.seq_at: list[str] = []

    def __len__(self) -> int:
        return len(self.seq_at)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.row_of

    def add(self, seq_id: str) -> int:
        if len(self.seq_at) >= self.cache.num_rows:
            raise RuntimeError(f"KV cache is full ({self.cache.num_rows} sequences); raise max_num_seqs")
        row = len(self.seq_at)
        self.row_of[seq_id] = row
        self.seq_at.append(seq_id)
        self.cache.lengths[row] = 0
        return row

    def remove(self, seq_id: str) -> None:
        row = self.row_of.pop(seq_id)
        last = len(self.seq_at) - 1
        if row != last:
            moved = self.seq_at[last]
            self.cache.move_row(last, row)
            self.seq_at[row] = moved
            self.row_of[moved] = row
        self.seq_at.pop()
        self.cache.lengths[last] = 0

    def rows_for(self, seq_ids: list[str]) -> torch.Tensor:
        """Row index of each id, in the given order."""
        return torch.tensor([self.row_of[seq_id] for seq_id in seq_ids], dtype=torch.long)


def ragged_forward(model, cache: RaggedKVCache, rows: slice, input_ids: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """Run ``model`` on ``input_ids`` ``[n, Q]`` at ``positions`` ``[n, Q]`` for cache ``rows``.

    Returns logits ``[n, Q, vocab]``. Keys/values of every query are written; the caller decides by
    ``cache.lengths`` which of them stay valid.
    """
    cache.bind(rows, positions)
    mask = cache.attention_mask(rows, positions, next(model.parameters()).dtype)
    with torch.inference_mode():
        output = model(input_ids=input_ids, position_ids=positions, attention_mask=mask, cache=cache,
                       use_cache=True)
    return output.logits


def prefill_row(model, table: RowTable, seq_id: str, prefix: list[int]) -> int:
    """Give ``seq_id`` a row and run ``prefix`` (all its tokens but the pending last one) into it."""
    row = table.add(seq_id)
    if prefix:
        positions = torch.arange(len(prefix))[None, :]
        ragged_forward(model, table.cache, slice(row, row + 1), torch.tensor([prefix]), positions)
    table.cache.lengths[row] = len(prefix)
    return row
