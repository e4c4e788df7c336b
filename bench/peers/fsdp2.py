#!/usr/bin/env python3
"""PyTorch FSDP2 (torch.distributed.fsdp.fully_shard) on the peer BERT, on a CPU mesh over Gloo,
in bench/peers/'s harness. Variants: reshard (reshard_after_forward=True, ZeRO-3's schedule) and
noreshard (False: parameters stay gathered from forward to backward, ZeRO-2's memory for them).
Each encoder layer is its own FSDP unit; the root unit holds the embeddings and the MLM head (the
tied word embedding is used by both, so it stays in the root).

    mpirun -np 2 python bench/peers/fsdp2.py --variant reshard [--parity]

Note [Gloo AVG]: FSDP2 reduce-scatters fp32 gradients with ReduceOp.AVG, which Gloo summed
(pytorch#162338); every unit is set to force SUM reductions with a post-division, exact either way.
(With torch 2.15 here, AVG was exact too: --parity passed with the setting off, 2026-11-26.)
"""
import torch
import torch.distributed as dist

import common


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(t):
    t = local(t)
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


class FSDP2(common.Peer):
    name = "fsdp2"

    def build(self, a, model, rank, world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,))
        reshard = a.variant == "reshard"
        units = [fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
                 for layer in model.layers]
        units.append(fully_shard(model, mesh=mesh, reshard_after_forward=reshard))
        for u in units:  # Note [Gloo AVG]
            u.set_force_sum_reduction_for_comms(True)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def forward_backward(self, batch):
        loss = common.mlm_loss(self.model, batch)
        loss.backward()
        return loss

    def step(self):
        self.opt.step()

    def full_params(self):
        return {n: p.full_tensor().detach() for n, p in self.model.named_parameters()}

    def full_grads(self):
        return {n: p.grad.full_tensor() for n, p in self.model.named_parameters()}

    def model_state(self):
        # FSDP2's own layout: each parameter, its gradient and AdamW's state are DTensors whose
        # local shard is what this rank holds.
        ps = list(self.model.parameters())
        return {"params": sum(tensor_bytes(p) for p in ps),
                "grads": sum(tensor_bytes(p.grad) for p in ps if p.grad is not None),
                "optimizer_state": sum(tensor_bytes(v) for st in self.opt.state.values()
                                       for v in st.values())}


if __name__ == "__main__":
    a = common.finish_args(common.arg_parser(__doc__, ["reshard", "noreshard"]).parse_args())
    common.exit_now(common.run(FSDP2(), a))
