"""The leakage-safe causal + document mask of the attention kernels: every masked (query, key) pair
and the diagonal safeguard's operand choice are here.

The rule (shared/design/hopper-fp8-attention.md, "Causal and document leakage"): no output at
position i may depend on an input that attention may not see from i, i.e. on a later token of the
same document (causal) or on any token of another document. Quantization statistics are the usual
path of such a leak, so the rule covers scales as well as scores:
- scores: on a diagonal tile a key is visible from a query iff it is at or before the query and
  inside the query's document (hide_invisible: key <= query, key < the document end, and with a
  short pair key >= the other document's last key). Off-diagonal tiles (every key before every
  query of the same document) need no mask: the kernels run them unmasked. Keys past the document
  end get score -inf (forward) or P = 0 (backward), and their K/V scales 0 (step_key_scales,
  bwd_device.load_row_scales), so a pad or another document's column adds exactly 0;
- scales: a scale shared by a block of keys leaks into a query before some key of the block, i.e.
  only on the diagonal tile. Block-scaled recipes (diagonal_copy) therefore read that tile's K and
  V from per-token copies (diagonal_source, step_key_scales); every block scale is document-local
  (quantization never spans a document boundary). sm_100a's MXFP8 forward, whose 32-key blocks
  share scales inside the tile, runs the pairs of the query's own 32-key block in bf16 instead and
  masks the keys after the query (hide_future).

Cross-length causal attention (queries at key positions p = i + Lk - Lq) keeps these rules unchanged: the
forward's query tiles are 128-position blocks of the key axis (schedules.varlen_tiles.cross_tile), so a tile's
row and key coordinates are key positions, its first key tile is the rows' own block (masked and per-token) and
every other tile lies wholly before it. Non-causal attention masks the document's end alone (causal=False) and
reads no per-token copy (no key is in a query's future).

Where each kernel calls it:
- sm90/attention_fwd.py: FlamiaFwdSm90.softmax (hide_invisible on the diagonal tile, diagonal_key_end;
  short pairs: consume_tile's key_lo), stage_key_scales and diagonal_half_scales (step_key_scales);
  load_tma reads the diagonal K and V tiles from the per-token copies under diagonal_copy;
- sm90/attention_bwd.py: FlamiaBwdDsBf16Sm90.tile_step (hide_invisible on the diagonal query tiles),
  consume (diagonal_key_end, pair_key_end; diagonal_source: phase 0's K/V scales), load_tma
  (diagonal_source: phase 0's K/V tiles);
- sm100/attention_fwd.py: FlamiaFwdSm100.softmax_tile (hide_future).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


def diagonal_source(diagonal_copy: bool, block, per_token):
    """The operand (tensor, TMA atom or tuple of them) of a diagonal tile: the per-token copy when the
    recipe's K/V scales are per block (diagonal_copy: a block scale would carry the tile's later keys
    into earlier queries), else the only one. Trace time."""
    return per_token if diagonal_copy else block


def diagonal_key_end(doc_len, key0):
    """The first key column of the tile starting at document key key0 that lies past the document end
    (keys at or past it are masked)."""
    return doc_len - key0


@cute.jit
def hide_invisible(values, fills, key, query, key_end, key_lo=None, causal: cutlass.Constexpr = True):
    """values (a tuple) where key is visible from query on a diagonal tile, else fills: key after
    the query (causal), key at or past key_end (the document end, diagonal_key_end), or below key_lo
    (a short pair's other document). key, query: positions in the same tile coordinates.
    causal=False (the non-causal forward's first tile, the document's last keys): the end alone."""
    if cutlass.const_expr(causal):
        if key > query:
            values = fills
    if key >= key_end:
        values = fills
    if cutlass.const_expr(key_lo is not None):
        if key < key_lo:
            values = fills
    return values


def hide_future(key, query, value, fill):
    """value, or fill when the key comes after the query (the sm_100a diagonal tile's causal mask, one
    select; keys past the document end come after every stored row)."""
    return cutlass.select_(key > query, fill, value)


@cute.jit
def pair_key_end(key_end, pair_first, i, n_diag):
    """The backward's key end of diagonal tile i (n_diag per head) for a warpgroup that holds a short
    pair's first document (pair_first): 0 on the second tile, whose queries are the other document's
    (every key of the warpgroup masked), else key_end. pair_first None: no pairs (key_end)."""
    end = key_end
    if cutlass.const_expr(pair_first is not None):
        if pair_first:
            if i % n_diag == 1:
                end = Int32(0)  # every key of this warpgroup is the other document's
    return end


@cute.jit
def step_key_scales(mSK, mSV, mSKt, mSVt, diagonal_copy: cutlass.Constexpr, i, key, kv_head, doc_start, doc_len):
    """(K scale, V scale) of one key of the forward's key step i (0: the diagonal tile, whose
    block-scaled recipes read the per-token copies' scales); 0 past the document end."""
    sk = Float32(0.0)
    sv = Float32(0.0)
    if key < doc_len:
        if cutlass.const_expr(diagonal_copy):
            if i == 0:
                sk = mSKt[doc_start + key, kv_head]
                sv = mSVt[doc_start + key, kv_head]
            else:
                sk = mSK[doc_start + key, kv_head]
                sv = mSV[doc_start + key, kv_head]
        else:
            sk = mSK[doc_start + key, kv_head]
            sv = mSV[doc_start + key, kv_head]
    return sk, sv
