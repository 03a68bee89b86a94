"""Ray placement with a deadline: a placement group that cannot be placed (a GPU config on a
machine without enough GPUs) would otherwise wait forever. Past `cluster.placement_timeout_s` the
group is removed and the run stops with one line: what was asked for and what the cluster has."""

from __future__ import annotations

from mcore_rl.preflight.bad_input import BadInput


class PlacementTimeout(BadInput):
    """The cluster cannot hold what the config asks for (within the deadline)."""


def _resources(res: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(res.items()) if k in ("CPU", "GPU")) or "nothing"


def _alive_nodes(ray) -> int:
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def reserve(bundles: list[dict], what: str, timeout_s: float, strategy: str = "PACK"):
    """A ready placement group of `bundles`, or PlacementTimeout after `timeout_s` seconds."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        kinds = sorted({_resources(b) for b in bundles})
        asked = f"{len(bundles)} bundle(s) of {' / '.join(kinds)}" + (f" ({strategy})" if len(bundles) > 1 else "")
        raise PlacementTimeout(
            f"cluster.placement_timeout_s = {timeout_s:g} s passed and Ray could not place {what}: asked for "
            f"{asked}; the cluster has {_resources(ray.cluster_resources())} in all over {_alive_nodes(ray)} "
            f"node(s), "
            f"{_resources(ray.available_resources())} free") from None
    return pg
