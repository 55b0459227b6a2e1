"""The environment of DeepEP's tests under ``scripts/deepep_tests.sh``, set in every process at start-up.

``TRITILE_DEEPEP_BACKEND=gloo``: ``torch.distributed.init_process_group`` uses this backend instead of the one the
test names (and drops ``device_id``, a CUDA device).

``TRITILE_DEEPEP_DEVICE=cpu`` (machines without GPUs): the device the tests call ``"cuda"`` is the CPU:

* factory functions and ``.to()`` given a CUDA device make CPU tensors, ``Tensor.cuda()`` returns the tensor,
  ``torch.set_default_device("cuda")`` sets the CPU;
* ``torch.cuda.synchronize`` / ``set_device`` / ``_sleep`` do nothing (CPU work is complete when a call returns),
  ``torch.cuda.Event`` records the wall clock (``elapsed_time`` in ms), ``current_stream`` / ``Stream`` are
  streams that need no waiting, ``get_device_properties`` describes the CPU (``multi_processor_count`` = cores).

``torch.cuda.is_available()`` stays False, so tritile itself never takes a CUDA path.  The tests' checks are
untouched.
"""

import os
import time

_BACKEND = os.environ.get("TRITILE_DEEPEP_BACKEND", "")
_DEVICE = os.environ.get("TRITILE_DEEPEP_DEVICE", "")


def _install_backend(backend: str) -> None:
    import torch.distributed as dist

    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        if args:
            kwargs["backend"] = backend
            args = args[1:]
        else:
            kwargs["backend"] = backend
        kwargs.pop("device_id", None)
        return original(*args, **kwargs)

    dist.init_process_group = init_process_group
    if backend == "gloo":
        _bytes_for_gloo(dist)


def _bytes_for_gloo(dist) -> None:
    """gloo's ``all_to_all_single`` / ``all_gather_into_tensor`` reject bfloat16 and FP8 tensors (NCCL takes
    them): send such tensors as their bytes (a uint8 view: the same bits, the same rows).  gloo's
    ``all_gather_into_tensor`` also rejects a stacked output ``(R, *input.shape)`` (NCCL takes it): pass it as the
    same memory viewed ``(R * input.shape[0], *input.shape[1:])``."""
    import torch

    unsupported = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}

    def as_bytes(t):
        if not isinstance(t, torch.Tensor) or t.dtype not in unsupported or not t.is_contiguous():
            return t
        if t.dim() == 0:
            return t.reshape(1).view(torch.uint8)
        return t.view(torch.uint8)

    a2a, gather = dist.all_to_all_single, dist.all_gather_into_tensor

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        return a2a(as_bytes(output), as_bytes(input), output_split_sizes, input_split_sizes, group=group,
                   async_op=async_op)

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if (isinstance(output_tensor, torch.Tensor) and isinstance(input_tensor, torch.Tensor)
                and input_tensor.dim() >= 1 and output_tensor.dim() == input_tensor.dim() + 1
                and tuple(output_tensor.shape[1:]) == tuple(input_tensor.shape) and output_tensor.is_contiguous()):
            output_tensor = output_tensor.view((-1,) + tuple(input_tensor.shape[1:]))
        return gather(as_bytes(output_tensor), as_bytes(input_tensor), group=group, async_op=async_op)

    dist.all_to_all_single = all_to_all_single
    dist.all_gather_into_tensor = all_gather_into_tensor


def _install_cpu() -> None:
    import torch
    from torch.overrides import TorchFunctionMode

    def cpu(dev):
        if isinstance(dev, str) and dev.split(":")[0] == "cuda":
            return "cpu"
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return torch.device("cpu")
        return dev

    class CudaIsCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to and len(args) > 1:
                args = (args[0], cpu(args[1])) + tuple(args[2:])
            return func(*args, **kwargs)

    CudaIsCpu().__enter__()  # stays active for the whole process

    original_default = torch.set_default_device

    def set_default_device(device):
        return original_default(cpu(device))

    torch.set_default_device = set_default_device

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            self.t = None

        def record(self, stream=None):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

        def synchronize(self):
            pass

        def query(self):
            return True

        def wait(self, stream=None):
            pass

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_event(self, event):
            pass

        def wait_stream(self, stream):
            pass

        def synchronize(self):
            pass

        def record_event(self, event=None):
            event = event or Event()
            event.record()
            return event

    class Props:
        name = "CPU (tritile deep_ep shim)"
        multi_processor_count = os.cpu_count() or 1
        total_memory = 0
        major, minor = 0, 0

    cuda = torch.cuda
    cuda.synchronize = lambda device=None: None
    cuda.set_device = lambda device: None
    cuda.current_device = lambda: 0
    cuda._sleep = lambda cycles: None
    cuda.Event = Event
    cuda.Stream = Stream
    cuda.current_stream = lambda device=None: Stream()
    cuda.get_device_properties = lambda device=None: Props()
    cuda.get_device_name = lambda device=None: Props.name
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None


if _BACKEND:
    _install_backend(_BACKEND)
if _DEVICE == "cpu":
    _install_cpu()
