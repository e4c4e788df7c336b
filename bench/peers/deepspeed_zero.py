#!/usr/bin/env python3
"""DeepSpeed ZeRO-1/2/3 on the peer BERT, on CPU over Gloo, in bench/peers/'s harness.

Variants: zero1, zero2, zero3 (torch.optim.AdamW handed to deepspeed.initialize) and
zero1-cpuadam, zero2-cpuadam, zero3-cpuadam (DeepSpeedCPUAdam, adamw_mode, JIT-built with g++ and
ninja on first use into TORCH_EXTENSIONS_DIR; default /var/cache/shardopt/torch_extensions, outside
the clone). fp32 throughout, no clipping, micro-batch = --batch, one accumulation step.

    mpirun -np 2 python bench/peers/deepspeed_zero.py --variant zero2 [--parity]

No deepspeed launcher: mpirun's (or torchrun's) variables become torch's (common.init_env), and
deepspeed.init_distributed(dist_backend="gloo") joins them. DS_ACCELERATOR=cpu is set here: with
no oneCCL bindings installed, DeepSpeed's CPU accelerator names Gloo as its backend.
"""
import os
import sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/var/cache/shardopt/torch_extensions")

import torch  # noqa: E402

import common  # noqa: E402

VARIANTS = [f"zero{s}{o}" for s in (1, 2, 3) for o in ("", "-cpuadam")]


def tensor_bytes(t):
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def flatten(x):
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    return [t for v in x for t in flatten(v)] if isinstance(x, (list, tuple)) else []


def storage_bytes(tensors, exclude=()):
    """Bytes of the distinct storages under `tensors` (DeepSpeed's gradient structures are views
    into a few flat buffers, and some into the same one), less those under `exclude`."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}
    for t in tensors:
        if t.untyped_storage().data_ptr() in skip:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class DeepSpeedZero(common.Peer):
    name = "deepspeed"

    def build(self, a, model, rank, world):
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        self.stage = int(a.variant[4])
        if self.stage == 3:  # the tied decoder reads word.weight outside word's forward
            deepspeed.zero.register_external_parameter(model, model.word.weight)
        if a.variant.endswith("cpuadam"):
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            opt = DeepSpeedCPUAdam(model.parameters(), lr=a.lr, weight_decay=a.weight_decay,
                                   adamw_mode=True)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
        config = {
            "train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "steps_per_print": 1 << 30,
            # Buckets of 2^22 elements (16 MiB fp32, shardopt's default bucket) rather than
            # DeepSpeed's 5e8 elements, whose 2 GB stage-3 buffer would be charged to it.
            "zero_optimization": {"stage": self.stage, "reduce_bucket_size": 1 << 22,
                                  "allgather_bucket_size": 1 << 22},
        }
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                                           config=config)

    def forward_backward(self, batch):
        loss = common.mlm_loss(self.engine, batch)
        self.engine.backward(loss)
        return loss

    def step(self):
        self.engine.step()

    def _named(self):
        return list(self.engine.module.named_parameters())

    def full_params(self):
        import deepspeed
        named = self._named()
        with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=self.stage == 3):
            return {n: p.detach().clone() for n, p in named}

    def full_grads(self):
        from deepspeed.utils import safe_get_full_grad
        out = {}
        for n, p in self._named():
            g = safe_get_full_grad(p)
            if g is None:
                return None
            out[n] = g.detach().clone()
        return out

    def model_state(self):
        # DeepSpeed's own structures: the flat parameter groups the model's parameters view
        # (stages 1-2) or their shards (stage 3), its fp32 master partitions, the gradient
        # partitions it keeps, and the wrapped optimizer's state.
        z = self.opt
        out = {}
        if self.stage == 3:
            out["params"] = sum(tensor_bytes(p.ds_tensor) for _, p in self._named())
            out["fp32_partitions"] = sum(tensor_bytes(t) for t in z.fp32_partitioned_groups_flat)
            # the per-parameter gradient partitions are views into this one buffer
            out["grads"] = tensor_bytes(getattr(z, "grad_partitions_flat_buffer", None))
        else:
            out["params"] = sum(tensor_bytes(t) for t in z.bit16_groups_flat)
            out["fp32_partitions"] = sum(tensor_bytes(t) for t in z.single_partition_of_fp32_groups)
            # its reduce bucket (ipg_buffer) is a communication buffer: counted apart (Note
            # [Model state, as ZeRO defines it] in bench/compare_peers.py)
            bucket = flatten([getattr(z, "ipg_buffer", None)])
            out["buffers"] = storage_bytes(bucket)
            out["grads"] = storage_bytes(
                flatten([z.grads_in_partition, z.averaged_gradients,
                         getattr(z, "all_grad_tensors", {})])
                + [t.grad for t in z.single_partition_of_fp32_groups if t.grad is not None]
                + [p.grad for _, p in self._named() if p.grad is not None],
                exclude=bucket)
        out["optimizer_state"] = sum(tensor_bytes(v) for st in z.optimizer.state.values()
                                     for v in st.values())
        return out


def build_ops():
    """JIT-builds (or finds in TORCH_EXTENSIONS_DIR) the two ops the peers load: one process at a
    time, so that two ranks do not wait on each other's build lock under a test's timeout."""
    from deepspeed.accelerator import get_accelerator
    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            sys.exit(f"[peer] DeepSpeed's accelerator {get_accelerator()._name} has no {name}")
        builder.load()
        print(f"[peer] {name}: loaded from {os.environ['TORCH_EXTENSIONS_DIR']}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--build-ops"]:
        build_ops()
        sys.exit(0)
    a = common.finish_args(common.arg_parser(__doc__, VARIANTS).parse_args())
    common.exit_now(common.run(DeepSpeedZero(), a))
