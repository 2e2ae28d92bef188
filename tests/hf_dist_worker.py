"""One rank of tests/integrations/test_hf_distributed.py: FSDP2 and DTensor lm_head weights on gloo (CPU)."""
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

import flce
from dist_launch import finish_worker
from hf_models import batch, tiny_model


def _check(case, model, ref, rank):
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        err = ((g - q.grad).abs().max() / q.grad.abs().max()).item()
        worst = max(worst, err)
    # Both sides compute in fp32; only summation orders differ.
    assert worst < 2e-5, (case, worst)
    if rank == 0:
        print(f"{case}: max relative gradient difference {worst:.2e}", flush=True)


def fsdp(case, rank, world):
    """Every rank has its own data; FSDP2 averages the gradients over ranks."""
    # The root case uses a tied, softcapped model; a separate head unit needs an untied one.
    model = tiny_model("llama" if case == "fsdp-head" else "gemma2", seed=5)
    ref = copy.deepcopy(model)
    data = [batch(seed=10 + r) for r in range(world)]
    for layer in model.model.layers:
        fully_shard(layer)
    if case == "fsdp-head":
        fully_shard(model.lm_head)  # its own unit, resharded after its (empty) call
    fully_shard(model)
    flce.patch(model)
    ids, mask, labels = data[rank]
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None
    out.loss.backward()
    sum(ref(input_ids=i, attention_mask=m, labels=l).loss for i, m, l in data).div(world).backward()
    _check(case, model, ref, rank)


def dtensor(case, rank, world):
    """lm_head.weight a DTensor (the same data on every rank, as in tensor parallelism)."""
    placement = {"replicate": Replicate(), "shard1": Shard(1), "shard0": Shard(0)}[case[8:]]
    mesh = init_device_mesh("cpu", (world,))
    model = tiny_model("llama", seed=6)
    ref = copy.deepcopy(model)
    model.lm_head.weight = torch.nn.Parameter(
        distribute_tensor(model.lm_head.weight.detach(), mesh, [placement]))
    flce.patch(model)
    ids, mask, labels = batch(seed=20)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * ref_loss.item(), (case, loss, ref_loss)
    _check(case, model, ref, rank)


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for case in sys.argv[1:]:
            (fsdp if case.startswith("fsdp") else dtensor)(case, rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    finish_worker()  # (the group is gone already)
