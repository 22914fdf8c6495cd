"""`restack_kept`: the one walk that lays the kept layers of a demotion out again after the base."""

from __future__ import annotations

from cache.layer_table import LayerKind, LayerSpan
from sessions.turn.window import KeptLayers, restack_kept


def test_kept_layers_follow_the_base_contiguously_with_every_token_held_again() -> None:
    first = LayerSpan(LayerKind.BASE, 0, 3, 4, 4)  # pinned
    dropped = LayerSpan(LayerKind.TURN, 1, 2, 7, 7)
    evicted = LayerSpan(LayerKind.TURN, 2, 2, 9, 30, evicted_tokens=3)  # held 2 of 5, position kept
    layers = [(first, (40, 41, 42)), (dropped, (70, 71)), (evicted, (90, 91, 92, 93, 94))]

    kept = restack_kept(layers, [dropped], base_tokens=4)

    assert kept == KeptLayers(
        ids=(40, 41, 42, 90, 91, 92, 93, 94),
        spans=(
            LayerSpan(LayerKind.BASE, 0, 3, 4, 4),
            LayerSpan(LayerKind.TURN, 2, 5, 9, 7),  # re-prefilled whole, right after the first
        ),
    )


def test_nothing_demoted_keeps_every_layer_in_place() -> None:
    spans = [LayerSpan(LayerKind.TURN, 0, 2, 0, 0), LayerSpan(LayerKind.TURN, 1, 1, 2, 2)]
    kept = restack_kept([(spans[0], (5, 6)), (spans[1], (7,))], [], base_tokens=0)
    assert kept == KeptLayers((5, 6, 7), tuple(spans))
