#!/usr/bin/env python3
"""shardopt itself from Python on the peer BERT, in bench/peers/'s harness: the same model, data,
loop and parity check as the peers, trained through the bindings (`import shardopt`, target
shardopt_python; PYTHONPATH=<build>/python) with shardopt.DistributedOptimizer("adamw") at stage
0, 1, 2 or 3 (variants s0-s3; stage 3 without units=: the optimizer derives its units from the
parameter names, with the default UnitPolicy). Default bucket size and overlap, fp32, no clipping.

    PYTHONPATH=build-pip/python mpirun -np 2 python bench/peers/shardopt_py.py --variant s2 \
        [--parity]

Communicator: MPI (shardopt.init_from_env(backend="mpi")), the engine `bert_pretrain` uses under
mpirun, so these rows differ from the C++ trainer's only by the Python side. The harness's own
collectives (results, the parity flag) run over a torch.distributed Gloo group beside it.
Model state is shardopt's accounting, opt.memory() (the C++ rows' numbers); bytes communicated
are shardopt's count, StepStats.comm_elements x 4 bytes (shardopt's MPI traffic never passes
torch.distributed). The step-1 averaged gradient, which shardopt keeps inside its buffers, is read
after step 1 from AdamW's consolidated state in torch's format: exp_avg = (1 - beta1) g then.
"""
import gc
import sys

import torch.distributed as dist

import common

VARIANTS = ["s0", "s1", "s2", "s3"]
BETA1 = 0.9  # AdamW's default, the reference's too


class ShardoptPy(common.Peer):
    name = "shardopt"

    def build(self, a, model, rank, world):
        import shardopt
        dist.init_process_group("gloo")  # the harness's report and flag only
        comm = shardopt.init_from_env(backend="mpi")
        self.stage, self.rank, self.model = int(a.variant[1]), rank, model
        params = model if self.stage == 3 else model.named_parameters()
        self.opt = shardopt.DistributedOptimizer(params, "adamw", comm=comm, stage=self.stage,
                                                 lr=a.lr, weight_decay=a.weight_decay,
                                                 betas=(BETA1, 0.999))
        self.names = [n for n, _ in model.named_parameters()]
        self.elem_bytes = next(model.parameters()).element_size()
        self.sent = 0

    def zero_grad(self):
        self.opt.zero_grad()

    def forward_backward(self, batch):
        loss = common.mlm_loss(self.model, batch)
        self.opt.backward(loss)
        return loss

    def step(self):
        self.opt.step()
        self.sent += self.opt.last_step().comm_elements * self.elem_bytes

    def full_params(self):
        if self.stage == 3:  # nothing stays gathered between steps
            self.opt.gather_full_parameters()
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def first_step_grads(self):
        self.opt.consolidate_state_dict(0)
        if self.rank != 0:
            return {}
        state = self.opt.state_dict()["state"]  # ids in named_parameters() order
        return {n: state[i]["exp_avg"] / (1 - BETA1) for i, n in enumerate(self.names)}

    def sent_bytes(self):
        return self.sent

    def model_state(self):
        m = self.opt.memory()
        return {"params": m.param_bytes, "grads": m.grad_bytes,
                "optimizer_state": m.optimizer_state_bytes, "buffers": m.buffer_bytes}

    def close(self):
        """Note [MPI finalise at exit]: shardopt finalises the MPI it initialised in a static
        destructor, at a normal exit; common.exit_now()'s os._exit skips that, and mpirun then
        calls the job abnormal (exit 1). So this peer ends the Gloo group and its optimizer, then
        exits normally. gc first, as python_bindings/examples/train_bert.py's
        release_then_destroy does: once in CTest's peers_shardopt_py_s3_np2 a Gloo thread was
        still alive at interpreter exit and aborted dropping a work's tensor ("terminate called
        without an active exception"; not reproduced in 75 runs since), which is what a cycle
        keeping the group past destroy_process_group() leads to there."""
        gc.collect()
        dist.destroy_process_group()
        del self.opt


if __name__ == "__main__":
    a = common.finish_args(common.arg_parser(__doc__, VARIANTS).parse_args())
    peer = ShardoptPy()
    rc = common.run(peer, a)
    peer.close()
    sys.exit(rc)
