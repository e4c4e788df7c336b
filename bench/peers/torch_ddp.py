#!/usr/bin/env python3
"""PyTorch's own data parallelism on the peer BERT over Gloo: DDP + torch.optim.AdamW (`ddp`) and
DDP + ZeroRedundancyOptimizer(AdamW) (`zero`), as baseline/torch_zero_bert.py runs them, in
bench/peers/'s harness (parity, byte counts, one JSON report).

    mpirun -np 2 python bench/peers/torch_ddp.py --variant zero [--parity]
"""
import torch
import torch.nn as nn

import common


class TorchDDP(common.Peer):
    name = "torch"

    def build(self, a, model, rank, world):
        torch.distributed.init_process_group("gloo")
        self.model, self.params_numel = model, sum(p.numel() for p in model.parameters())
        self.ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        if a.parity:  # Python comm hook only where bytes are counted (timed runs keep C++'s)
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            self.ddp.register_comm_hook(torch.distributed.group.WORLD, allreduce_hook)
        if a.variant == "ddp":
            self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=a.lr, weight_decay=a.weight_decay)
            self.local = self.opt
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            self.opt = ZeroRedundancyOptimizer(self.ddp.parameters(),
                                               optimizer_class=torch.optim.AdamW, lr=a.lr,
                                               weight_decay=a.weight_decay)
            self.local = self.opt.optim

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def forward_backward(self, batch):
        loss = common.mlm_loss(self.ddp, batch)
        loss.backward()
        return loss

    def step(self):
        self.opt.step()

    def full_params(self):
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def full_grads(self):
        return {n: p.grad.clone() for n, p in self.model.named_parameters()}

    def model_state(self):
        # torch_zero_bert.py's accounting: parameters, gradients, DDP's bucket copy of the
        # gradients (gradient_as_bucket_view off) and the local optimizer's state tensors.
        p = sum(t.numel() * t.element_size() for t in self.model.parameters())
        g = sum(t.grad.numel() * t.grad.element_size() for t in self.model.parameters()
                if t.grad is not None)
        s = sum(v.numel() * v.element_size() for st in self.local.state.values()
                for v in st.values() if torch.is_tensor(v))
        return {"params": p, "grads": g, "ddp_bucket": p, "optimizer_state": s}

    def extra_state_bytes(self):
        return 4 * self.params_numel  # DDP's buckets live in C++, out of gc's reach


if __name__ == "__main__":
    a = common.finish_args(common.arg_parser(__doc__, ["ddp", "zero"]).parse_args())
    common.exit_now(common.run(TorchDDP(), a))
