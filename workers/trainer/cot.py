"""Chain-of-thought masks: which response tokens lie inside ``<think>`` ... ``</think>``.

EGPO's entropy bonus averages token entropy over the chain of thought only. The rules, applied
to each response row independently:

- CoT tokens are those strictly between a start marker and the next end marker; the markers
  themselves are not CoT.
- Only tokens inside the response mask count. Markers are recognised everywhere in the row,
  including positions outside the mask: a chat template may insert ``<think>`` as context
  (mask 0) before the model continues the thought (mask 1), and that thought is CoT.
- A block that is never closed runs to the end of the response.
- An end marker with no opener before it closes a block that began at the first response
  token (templates that put ``<think>`` in the prompt produce exactly this).
- Several blocks (one per turn of a multi-turn response) all count. A second start marker
  inside an open block keeps it open; a second end marker outside a block changes nothing.
"""

from __future__ import annotations

import torch

from workers.trainer.checks import require_2d, require_same_shape

__all__ = ["cot_mask"]


def cot_mask(
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cot_start_id: int,
    cot_end_id: int,
) -> torch.Tensor:
    """Boolean mask ``(bs, response_length)``: True on chain-of-thought tokens in the mask.

    ``responses`` holds token ids ``(bs, response_length)`` (an integer tensor);
    ``response_mask`` has the same shape, nonzero where a token is trained on.

    Vectorised: the state machine runs over the (sparse) list of markers, and the state of every
    position is the parity of a cumulative sum of the markers that change it.

    Raises TypeError when ``responses`` is not an integer tensor or a marker id is not an int;
    ValueError when shapes differ, a tensor is not 2-D, or the two marker ids are equal.
    """
    require_2d("responses", responses)
    require_same_shape("responses", responses, response_mask=response_mask)
    if responses.is_floating_point() or responses.is_complex() or responses.dtype == torch.bool:
        raise TypeError(f"responses must hold integer token ids, got dtype {responses.dtype}")
    for name, value in (("cot_start_id", cot_start_id), ("cot_end_id", cot_end_id)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int token id, got {type(value).__name__} {value!r}")
    if cot_start_id == cot_end_id:
        raise ValueError(f"cot_start_id and cot_end_id must differ, both are {cot_start_id}")

    if responses.numel() == 0:
        return torch.zeros(responses.shape, dtype=torch.bool, device=responses.device)
    bs, length = responses.shape
    is_marker = (responses == cot_start_id) | (responses == cot_end_id)
    # Markers are sparse (a few per row), so the state machine runs on their list: (k,) each.
    rows, cols = is_marker.nonzero(as_tuple=True)
    opens = responses[rows, cols] == cot_start_id
    new_row = torch.ones_like(rows, dtype=torch.bool)
    new_row[1:] = rows[1:] != rows[:-1]
    # A marker changes the state unless it repeats the previous marker of its row (a second
    # opener inside a block, a second closer outside one). The first marker of a row always
    # changes it: a row whose first marker is a closer starts inside a block.
    changes = new_row.clone()
    changes[1:] |= opens[1:] != opens[:-1]
    # (bs, response_length): number of state changes at or before each position; a row that
    # starts inside a block gets one extra change at position 0. Only the parity matters, so a
    # uint8 cumsum (which wraps at 256) is enough.
    flips = torch.zeros((bs, length), dtype=torch.uint8, device=responses.device)
    flips.index_put_(
        (rows[changes], cols[changes]), torch.ones_like(cols[changes], dtype=torch.uint8)
    )
    first_rows = rows[new_row & ~opens]
    flips.index_put_(
        (first_rows, torch.zeros_like(first_rows)),
        torch.ones_like(first_rows, dtype=torch.uint8),
        accumulate=True,
    )
    inside = torch.cumsum(flips, dim=1, dtype=torch.uint8).bitwise_and_(1).bool()
    return inside & ~is_marker & (response_mask != 0)
