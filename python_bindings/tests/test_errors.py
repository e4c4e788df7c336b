"""Bad arguments raise Python exceptions that carry the C++ message, typed by ErrorKind."""
import datetime

import pytest
import torch

import shardopt
from helpers import global_batch, loss_fn, make_model


@pytest.fixture(scope="module")
def comm():
    return shardopt.make_single_communicator()


KINDS = [
    ("InvalidArgument", shardopt.InvalidArgumentError, ValueError),
    ("Mismatch", shardopt.MismatchError, RuntimeError),
    ("Timeout", shardopt.CommTimeoutError, TimeoutError),
    ("Communication", shardopt.CommunicationError, RuntimeError),
    ("Checkpoint", shardopt.CheckpointError, RuntimeError),
    ("Unsupported", shardopt.UnsupportedError, NotImplementedError),
    ("Internal", shardopt.InternalError, RuntimeError),
]


@pytest.mark.parametrize("kind,cls,builtin", KINDS)
def test_every_error_kind_maps_to_its_type(kind, cls, builtin):
    with pytest.raises(cls) as info:
        shardopt._C._raise_for_test(kind, f"shardopt[rank 0/1] what went wrong ({kind})")
    e = info.value
    assert isinstance(e, shardopt.Error) and isinstance(e, RuntimeError)
    assert isinstance(e, builtin)
    assert str(e) == f"shardopt[rank 0/1] what went wrong ({kind})"
    assert e.kind == kind and e.rank == -1


def test_invalid_stage_is_a_value_error_with_the_cpp_message(comm):
    with pytest.raises(ValueError, match=r"options: stage must be 0, 1, 2 or 3, got 7") as info:
        shardopt.DistributedOptimizer(make_model().named_parameters(), comm=comm, stage=7)
    assert isinstance(info.value, shardopt.InvalidArgumentError)
    assert info.value.kind == "InvalidArgument"
    assert "(options.cpp:" in str(info.value)  # where C++ raised it


@pytest.mark.parametrize("field,value,message", [
    ("bucket_bytes", -1, r"bucket_bytes must be >= 0 \(0: sized from the model\), got -1"),
    ("grad_accumulation_steps", 0, "grad_accumulation_steps must be at least 1, got 0"),
    ("max_grad_norm", -1.0, "max_grad_norm must be >= 0"),
    ("align_bytes", 48, "align_bytes must be a positive power of two, got 48"),
])
def test_invalid_options(comm, field, value, message):
    with pytest.raises(shardopt.InvalidArgumentError, match=message):
        shardopt.DistributedOptimizer(make_model().named_parameters(), comm=comm,
                                      **{field: value})
    with pytest.raises(ValueError, match=message):
        shardopt.ZeroOptions(**{field: value}).validate()


def test_zero_options_fields():
    o = shardopt.ZeroOptions(stage=1, precision="fp32", timeout=30, max_grad_norm=1.0)
    assert (o.stage, o.precision, o.max_grad_norm) == (1, "fp32", 1.0)
    assert o.timeout == datetime.timedelta(seconds=30)
    o.timeout = datetime.timedelta(milliseconds=1500)
    assert o.timeout.total_seconds() == 1.5
    assert "stage=1" in repr(o)
    with pytest.raises(ValueError, match="precision must be one of fp32, fp16, bf16, got 'fp8'"):
        shardopt.ZeroOptions(precision="fp8")
    with pytest.raises(ValueError, match="offload must be one of none, cpu, got 'disk'"):
        shardopt.ZeroOptions(offload="disk")
    with pytest.raises(ValueError, match="ZeroOptions: unknown field 'stages'"):
        shardopt.ZeroOptions(stages=2)
    with pytest.raises(ValueError, match="ZeroOptions: unknown field 'validate'"):
        shardopt.ZeroOptions(validate=1)
    with pytest.raises(ValueError, match="timeout must be positive"):
        shardopt.ZeroOptions(timeout=0)
    with pytest.raises(ValueError, match="timeout must be a datetime.timedelta or a number"):
        shardopt.ZeroOptions(timeout="10s")


@pytest.mark.parametrize("spec,kwargs,message", [
    ("adamw", dict(momentum=0.9),
     "adamw has no hyper-parameter 'momentum'; expected one of lr, betas, eps, weight_decay, "
     "amsgrad"),
    ("adamw", dict(lr=-1), r"adamw hyper-parameter 'lr' must lie in \[0, inf\), got -1"),
    ("adam", dict(betas=(0.9,)), r"'betas' must be a pair \(beta1, beta2\), got \(0.9,\)"),
    ("adam", dict(betas=(0.9, 1.0)), r"adam betas must lie in \[0, 1\), got \(0.9, 1\)"),
    ("adamw", dict(amsgrad=1), "'amsgrad' must be True or False, got 1"),
    ("adamw", dict(lr="fast"), "'lr' must be a number, got 'fast'"),
    ("sgd", dict(), "sgd needs a learning rate"),
    ("sgd", dict(lr=0.1, nesterov=True), "Nesterov momentum requires a momentum"),
    ("adamax", dict(), "unknown optimizer 'adamax'; expected one of adamw, adam, sgd"),
    ({"lr": 0.1}, dict(), "an optimizer spec dict needs a 'name'"),
])
def test_bad_hyperparameters(comm, spec, kwargs, message):
    with pytest.raises(ValueError, match=message):
        shardopt.DistributedOptimizer(make_model().named_parameters(), spec, comm=comm, **kwargs)


def test_bad_group_override(comm):
    model = make_model()
    groups = [{"params": [model.mid.weight], "momentum": 0.5}, {"params": [model.out.weight]}]
    with pytest.raises(ValueError, match="adamw has no hyper-parameter 'momentum'"):
        shardopt.DistributedOptimizer(groups, "adamw", comm=comm)


def test_bad_parameters(comm):
    with pytest.raises(ValueError, match="parameters must be float32 or float64, 'w' is"):
        shardopt.DistributedOptimizer([("w", torch.zeros(3, dtype=torch.float16,
                                                         requires_grad=True))], comm=comm)
    with pytest.raises(ValueError, match="no trainable parameters"):
        shardopt.DistributedOptimizer([("w", torch.zeros(3))], comm=comm)
    with pytest.raises(ValueError, match="empty parameter list"):
        shardopt.DistributedOptimizer([], comm=comm)
    with pytest.raises(ValueError, match="two different tensors are both named 'w'"):
        shardopt.DistributedOptimizer([("w", torch.zeros(3, requires_grad=True)),
                                       ("w", torch.zeros(2, requires_grad=True))], comm=comm)
    with pytest.raises(TypeError, match="not a Tensor"):
        shardopt.DistributedOptimizer([("w", 3.0)], comm=comm)
    leaf = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        shardopt.DistributedOptimizer([leaf * 2], comm=comm)


def test_structural_hyperparameter_change_is_refused(comm):
    model = make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "sgd", comm=comm, lr=0.1,
                                        momentum=0.9)
    opt.param_groups[0]["momentum"] = 0.0
    with pytest.raises(ValueError, match="needs other optimizer state than was allocated"):
        opt.step()
    opt.param_groups[0]["momentum"] = 0.5  # non-zero to non-zero is fine
    opt.step()
    opt.param_groups[0]["lr"] = -0.1
    with pytest.raises(ValueError, match="sgd hyper-parameter 'lr' must lie in"):
        opt.step()


def test_layout_is_fixed_and_state_is_sharded(comm):
    model = make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm)
    with pytest.raises(shardopt.InvalidArgumentError,
                       match="add_param_group after construction is not supported"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    # The state is sharded: state_dict() needs consolidate_state_dict() first, and goes stale.
    with pytest.raises(shardopt.UnsupportedError,
                       match="call consolidate_state_dict.*save_checkpoint"):
        opt.state_dict()
    opt.consolidate_state_dict(0)
    assert opt.state_dict()["state"] == {}  # torch keeps no AdamW state before the first step
    opt.zero_grad()
    loss_fn(model, *global_batch(0)).backward()
    opt.step()
    with pytest.raises(shardopt.UnsupportedError, match="consolidated at step 0 is stale"):
        opt.state_dict()
    with pytest.raises(ValueError, match=r"`to` must be a rank in \[0, 1\)"):
        opt.consolidate_state_dict(1)


def test_factory_errors(comm):
    model = make_model()
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer, got int"):
        shardopt.DistributedOptimizer(model.named_parameters(), lambda shard: 3, comm=comm)
    groups = [{"params": [model.mid.weight], "lr": 0.5}]
    with pytest.raises(ValueError, match="factory-built optimizer runs one set"):
        shardopt.DistributedOptimizer(groups, torch.optim.Adamax, comm=comm)
    opt = shardopt.DistributedOptimizer(model.named_parameters(), torch.optim.Adamax, comm=comm)
    for call in (lambda: opt.consolidate_state_dict(0), lambda: opt.save_checkpoint("x")):
        with pytest.raises(shardopt.UnsupportedError, match="factory-built|ShardOptimizerFactory"):
            call()


def test_torch_class_falling_back_to_the_factory_path_warns(comm):
    model = make_model()
    with pytest.warns(UserWarning, match=r"AdamW with \['foreach'\] runs as that torch optimizer"):
        opt = shardopt.DistributedOptimizer(model.named_parameters(), torch.optim.AdamW,
                                            comm=comm, lr=0.01, foreach=False)
    assert isinstance(opt._inner, torch.optim.AdamW)


def test_communicator_errors(comm):
    with pytest.raises(ValueError, match="init_from_env: unknown backend 'bogus'"):
        shardopt.init_from_env(backend="bogus")
    with pytest.raises(ValueError, match=r"comm.all_reduce: tensor must be contiguous, got \[3, 2\]"):
        comm.all_reduce(torch.zeros(2, 3).t())
    with pytest.raises(ValueError, match="comm.all_reduce: tensor has unsupported dtype Bool"):
        comm.all_reduce(torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"comm.broadcast: root must lie in \[0, 1\), got 1"):
        comm.broadcast(torch.zeros(2), root=1)
    with pytest.raises(ValueError, match="comm.all_gather: output must hold world size x input"):
        comm.all_gather(torch.zeros(2), torch.zeros(3))


def test_estimator_errors():
    with pytest.raises(ValueError, match="stage must be 0..3"):
        shardopt.estimate(1000, world=2, stage=4)
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        shardopt.estimate(1000, precision="fp8")
    with pytest.raises(ValueError, match="unknown BERT preset 'huge'"):
        shardopt.bert_parameter_count("huge")
