"""The actor at PP=2 against PP=1: every MegatronActor method from the same HF weights.

Used by tests/e2e/test_actor_pp.py (gloo processes on CPU); also runnable by hand, on GPUs over NCCL
(fp32; each layout in fresh processes, one GPU each) or on the CPU:

    python tests/support/actor_pp_scenario.py --out /tmp/actor_pp --gpus 4   # all layouts
    python tests/support/actor_pp_scenario.py --out /tmp/actor_pp --gpus 2   # PP=2 against PP=1 only
    python tests/support/actor_pp_scenario.py --out /tmp/actor_pp --cpu      # all layouts, gloo

Each layout runs, for each family: log_probs, ref_log_probs, values, one PPO update (one
optimizer step over three micro-batches of different packed lengths), log_probs again, one
critic update, values again, and generate (4 sampled tokens). Prints the largest differences
as JSON; exits 1 when a pair of layouts disagrees.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from mcore_rl.config import sections as C  # noqa: E402
from tests.support.rl_batch import P, rl_batch  # noqa: E402

MICRO = 2  # samples per micro-batch: three micro-batches of different packed lengths in one optimizer step
FAMILIES = ("deepseek_v3", "llama")  # MoE + MLA (2 layers a stage); dense with tied embeddings (1 a stage)
# (world, tp, pp, ep, families); each PP=2 layout is compared with the PP=1 one of the same TP x DP x EP
LAYOUTS = ((1, 1, 1, 1, FAMILIES), (2, 1, 2, 1, FAMILIES), (2, 1, 1, 2, FAMILIES[:1]), (4, 1, 2, 2, FAMILIES[:1]))
TP_LAYOUTS = ((2, 2, 1, 1, FAMILIES), (4, 2, 2, 1, FAMILIES))  # sequence parallel activations between stages
PER_TOKEN = ("log_probs", "ref", "values0", "log_probs_after", "values")


def prepare(root: str) -> None:
    """Tiny HF models (every layout starts from the same ones), an RL batch."""
    from tests.support.tiny_models import make_hf_model

    for fam in FAMILIES:
        make_hf_model(fam, os.path.join(root, fam, "hf"))
    torch.save(rl_batch(), os.path.join(root, "batch.pt"))


def name(tp: int, pp: int, ep: int) -> str:
    return f"tp{tp}pp{pp}ep{ep}"


def actor_cfg(tp: int, pp: int, ep: int) -> dict:
    cfg = C.config_from_dict(C.apply_overrides({}, [
        f"parallel.tp={tp}", f"parallel.etp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}", "model.dtype=fp32",
        "rollout.n=1", "actor.ppo_mini_batch_size=6",
        f"actor.micro_batch_size={MICRO}", "actor.lr=1.0", "actor.weight_decay=0", "actor.entropy_coeff=0.01",
        "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1",
        "actor.router_bias_update_rate=1e-3", "critic.enabled=true", "critic.lr=1.0", "critic.weight_decay=0",
        f"critic.micro_batch_size={MICRO}"]))
    d = C.to_dict(cfg)
    # eps = 1 makes Adam's first step ~ lr * grad: the comparison checks gradients, not the sign
    # of rounding noise in near-zero grads
    d["actor"]["adam_eps"] = d["critic"]["adam_eps"] = 1.0
    return d


def as_driver(value):
    """What the trainer's driver makes of one call: the reporters' results (one per DP rank) in
    rank order, per-sample tensors concatenated and stats averaged; every rank gets it."""
    import torch.distributed as dist

    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    got = [g for g in got if g is not None]
    if isinstance(got[0], dict):
        return {k: sum(g[k] for g in got) / len(got) for k in got[0]}
    if isinstance(got[0], tuple):  # generate: (tokens, log-probs)
        return tuple(torch.cat(parts) for parts in zip(*got))
    return torch.cat(got)


def run_actor(rank: int, world: int, port: int, root: str, tp: int, pp: int, ep: int, fams) -> None:
    """Every actor method at TP=tp x PP=pp x EP=ep, for each family in turn; rank 0 saves the results.
    The actor sets up the process group unless the caller already has (tests/support/distributed.py)."""
    from mcore_rl.actor import MegatronActor
    from mcore_rl.algos.rollout_correction import compute_rollout_correction
    from mcore_rl.rollout.embedded import sample_on_shards

    for fam in fams:
        batch = torch.load(os.path.join(root, "batch.pt"), weights_only=True)
        actor = MegatronActor(rank, world, port, os.path.join(root, fam, "hf"), actor_cfg(tp, pp, ep),
                              init={"policy": os.path.join(root, fam, "hf")})
        out = {"log_probs": as_driver(actor.log_probs(batch)), "ref": as_driver(actor.ref_log_probs(batch)),
               "values0": as_driver(actor.values(batch))}
        batch.update(old_log_probs=out["log_probs"], ref_log_probs=out["ref"], values=out["values0"])
        # token-level TIS at cap 2, as the driver weights the policy loss (mcore_rl.loop.step_batch.correct_rollout)
        batch["rollout_is_weights"] = compute_rollout_correction(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], rollout_is="token",
            rollout_is_threshold=2.0)[0]
        out["update"] = as_driver(actor.update(batch))
        out["log_probs_after"] = as_driver(actor.log_probs(batch))
        out["critic"] = as_driver(actor.update_critic(batch))
        out["values"] = as_driver(actor.values(batch))
        prompts = batch["tokens"][:, :P]
        seeds = 11 + torch.arange(len(prompts))
        out["generate"] = as_driver(sample_on_shards(actor, prompts, batch["attention_mask"][:, :P], seeds, 4, 1.0, 1.0))
        if rank == 0:
            torch.save(out, os.path.join(root, fam, f"{name(tp, pp, ep)}.pt"))
        actor.ps.destroy_model_parallel()  # make room for the next family's actor


def differences(got: dict, ref: dict) -> dict:
    """Largest |difference| of each per-token output, largest relative one of the stats, and
    how many sampled tokens differ."""
    out = {key: (got[key] - ref[key]).abs().max().item() for key in PER_TOKEN}
    for key in ("update", "critic"):  # losses, clip fractions, entropy, grad norm: all on the last stage
        if got[key].keys() != ref[key].keys():
            raise AssertionError(f"{key}: stats {sorted(got[key])} vs {sorted(ref[key])}")
        out[f"{key}_stats_rel"] = max(abs(got[key][s] - ref[key][s]) / max(abs(ref[key][s]), 1e-2)
                                      for s in ref[key])
    out["generate_tokens_differing"] = int((got["generate"][0] != ref["generate"][0]).sum())
    out["generate_logp"] = (got["generate"][1] - ref["generate"][1]).abs().max().item()
    return out


def agree(diff: dict, atol: float = 1e-5) -> bool:
    return (all(diff[k] < atol for k in (*PER_TOKEN, "generate_logp")) and diff["generate_tokens_differing"] == 0
            and diff["update_stats_rel"] < atol and diff["critic_stats_rel"] < atol)


def compare(root: str) -> dict:
    """{family/pair: differences}: each PP=2 layout that ran against its PP=1 layout."""
    out = {}
    for fam in FAMILIES:
        for _, tp, pp, ep, _ in (*LAYOUTS, *TP_LAYOUTS):
            a, b = name(tp, pp, ep), name(tp, 1, ep)
            pa, pb = (os.path.join(root, fam, f"{n}.pt") for n in (a, b))
            if pp > 1 and os.path.exists(pa) and os.path.exists(pb):
                out[f"{fam}/{a}_vs_{b}"] = differences(torch.load(pa, weights_only=True),
                                                       torch.load(pb, weights_only=True))
    return out


def _spawned(rank, world, port, root, *layout):
    os.environ.update(LOCAL_RANK=str(rank), TORCHDYNAMO_DISABLE="1")
    run_actor(rank, world, port, root, *layout)


def main() -> int:
    import torch.multiprocessing as mp

    from mcore_rl.parallel.groups import free_port

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="working folder; differences.json is written there")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpus", type=int, help="GPUs on this host (2 or more; 4 adds PP2 x DP2 x EP2 and TP2 x PP2)")
    where.add_argument("--cpu", action="store_true", help="gloo processes on the CPU")
    args = ap.parse_args()
    if args.gpus is not None and not 2 <= args.gpus <= torch.cuda.device_count():
        ap.error(f"--gpus {args.gpus}: this host has {torch.cuda.device_count()} GPUs; 2 or more needed")
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the actor picks NCCL whenever it sees a GPU
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(dir=args.out)
    prepare(root)
    most = args.gpus or 4
    for world, *layout in (*LAYOUTS, *TP_LAYOUTS):
        if world <= most:
            mp.start_processes(_spawned, args=(world, free_port(), root, *layout), nprocs=world, start_method="spawn")
    diffs = compare(root)
    with open(os.path.join(args.out, "differences.json"), "w") as f:
        json.dump(diffs, f, indent=1)
    print(json.dumps(diffs, indent=1))
    return 0 if all(agree(d) for d in diffs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
