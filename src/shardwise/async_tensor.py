"""Pending results of background collectives: ``redistribute(..., async_op=True)`` and
``DTensor.from_local(..., async_op=True)``.

Both return at once an ``AsyncDTensor``: global metadata (shape, dtype, placements) is known,
its components are being computed by the background worker (``comm.background``). The first
use of the components (any op, ``unpack``, ``full_tensor``...) waits, and so does ``wait()``.
``to_local()`` of a pending DTensor returns an ``AsyncCollectiveTensor``, a tensor that waits on
first use, as PyTorch's does. Results are those of the blocking path, bit for bit: the worker runs
the same plan on the same components.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import budget
from .comm import background
from .dtensor import (
    DTensor,
    _as_components,
    _broadcast_replicated,
    _grad_components,
    _Redistribute,
    _spec_from_components,
)
from .mesh import DeviceMesh
from .placements import Placement
from .redistribute import execute_plan, plan_redistribute
from .spec import DTensorSpec


class AsyncDTensor(DTensor):
    """A DTensor whose components a background collective is still computing."""

    @staticmethod
    def __new__(
        cls, work: background.Work, spec: DTensorSpec, *, requires_grad: bool = False
    ) -> AsyncDTensor:
        meta = spec.tensor_meta
        device = spec.mesh.device_of(spec.mesh.local_device_ids[0])
        out = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride, dtype=meta.dtype, device=device,
            requires_grad=requires_grad,
        )
        out._spec = spec
        out.__dict__["_ready"] = None
        out.__dict__["_work"] = work
        return out

    @property
    def _components(self) -> list[torch.Tensor]:  # type: ignore[override]
        work = self.__dict__["_work"]
        if work is not None:
            self.__dict__["_ready"] = list(work.wait())
            self.__dict__["_work"] = None
        return self.__dict__["_ready"]

    @_components.setter
    def _components(self, value: list[torch.Tensor]) -> None:
        self.__dict__["_ready"] = value
        self.__dict__["_work"] = None

    def is_pending(self) -> bool:
        """True while the background collective has not finished."""
        work = self.__dict__["_work"]
        return work is not None and not work.done()

    def wait(self) -> AsyncDTensor:
        """Block until the components are ready (an error of the collective is raised here)."""
        self._components  # noqa: B018 - reading them waits
        return self

    def to_local(self) -> torch.Tensor:
        """This process's component; while pending, a tensor that waits on first use."""
        work = self.__dict__["_work"]
        if work is None or (self.requires_grad and torch.is_grad_enabled()):
            return super().to_local()
        if len(self.device_mesh.local_device_ids) != 1:
            return super().to_local()  # raises LocalComponentsError
        device = self.device_mesh.local_device_ids[0]
        return AsyncCollectiveTensor(
            work,
            0,
            self._spec.local_shape(device),
            self.dtype,
            self.device_mesh.device_of(device),
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002
        state = "pending" if self.is_pending() else "ready"
        return f"Async{super().__repr__()[:-1]}, {state})"


class AsyncCollectiveTensor(torch.Tensor):
    """A plain tensor that a background collective is still computing: any op on it, and
    ``wait()``, first wait for the collective and then see the plain result."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        work: background.Work,
        index: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> AsyncCollectiveTensor:
        out = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        out._work, out._index = work, index
        return out

    def wait(self) -> torch.Tensor:
        """The plain tensor (component ``index`` of the job's result), once it is ready."""
        return self._work.wait()[self._index]

    def is_pending(self) -> bool:
        return not self._work.done()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        def unwrap(t: Any) -> Any:
            return t.wait() if isinstance(t, AsyncCollectiveTensor) else t

        args, kwargs = pytree.tree_map(unwrap, (args, kwargs or {}))
        return func(*args, **kwargs)

    def data_ptr(self) -> int:
        return self.wait().data_ptr()

    def tolist(self) -> Any:
        return self.wait().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.wait().numpy(force=force)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002
        state = "pending" if self.is_pending() else repr(self.wait())
        return f"AsyncCollectiveTensor({state})"


# ----- the async paths -----------------------------------------------------------------------


class _AsyncRedistribute(_Redistribute):
    """``_Redistribute`` whose forward hands the plan to the background worker."""

    @staticmethod
    def forward(ctx, dtensor: DTensor, target: tuple[Placement, ...]) -> DTensor:  # noqa: ANN001
        spec = dtensor._spec
        ctx.source = spec.placements
        ctx.dtypes = (None, dtensor.dtype)  # the blocking backward, without dtype changes
        plan = plan_redistribute(spec, target)

        def job() -> list[torch.Tensor]:
            return execute_plan(plan, spec.mesh, dtensor._components)

        # checked against the budgets now; the job charges them in this context's copy
        with budget.around("DTensor.redistribute", [("the DTensor", spec, plan)]):
            work = background.submit(job, f"redistribute of {spec} to {list(target)}")
        return AsyncDTensor(work, spec.with_placements(target))


def redistribute_async(dtensor: DTensor, target: tuple[Placement, ...]) -> AsyncDTensor:
    """``dtensor.redistribute(placements=target, async_op=True)``."""
    return _AsyncRedistribute.apply(dtensor, target)


class _AsyncFromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: DTensorSpec, run_check: bool, *components: torch.Tensor) -> DTensor:  # noqa: ANN001
        ctx.spec = spec

        def job() -> list[torch.Tensor]:
            ready = [
                c.wait() if isinstance(c, AsyncCollectiveTensor) else c.view_as(c)
                for c in components
            ]
            return _broadcast_replicated(spec, ready) if run_check else ready

        return AsyncDTensor(background.submit(job, f"from_local of {spec}"), spec)

    @staticmethod
    def backward(ctx, grad: DTensor):  # noqa: ANN001
        return (None, None, *_grad_components(grad, ctx.spec))


def from_local_async(
    local: torch.Tensor | Sequence[torch.Tensor],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    run_check: bool,
) -> AsyncDTensor:
    """``DTensor.from_local(..., async_op=True)``: components may be pending themselves."""
    components = _as_components(local, mesh, placements)
    spec = _spec_from_components(components, mesh, placements, shape, stride)
    return _AsyncFromLocal.apply(spec, run_check, *components)

