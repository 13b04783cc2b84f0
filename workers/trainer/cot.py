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

    Vectorised: the state at each position is decided by the last marker at or before it,
    found with a cumulative maximum over marker positions.

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
    is_start = responses == cot_start_id
    is_end = responses == cot_end_id
    is_marker = is_start | is_end
    length = responses.shape[1]
    positions = torch.arange(length, device=responses.device).expand_as(responses)
    # (bs, response_length): position of the last marker at or before each position, -1 if none.
    last_marker = torch.where(is_marker, positions, torch.full_like(positions, -1))
    last_marker = torch.cummax(last_marker, dim=1).values
    after_start = is_start.gather(1, last_marker.clamp(min=0)) & (last_marker >= 0)
    # Before any marker a row is inside a block only if its first marker is a closing one.
    has_marker = is_marker.any(dim=1)
    first_marker = is_marker.to(torch.uint8).argmax(dim=1)
    opens_inside = has_marker & is_end.gather(1, first_marker.unsqueeze(1)).squeeze(1)
    before_any = (last_marker < 0) & opens_inside.unsqueeze(1)
    inside = after_start | before_any
    return inside & ~is_marker & (response_mask != 0)
