"""Pending values of ``async_op``: the components of an ``AsyncDTensor`` (``dtensor.py``), and
``AsyncCollectiveTensor``, a plain tensor (``to_local()`` of a pending DTensor) that waits on
first use, as PyTorch's does. Both wait for the background worker (``comm.background``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .comm import background
from .components import new_wrapper
from .spec import DTensorSpec
from .torch_compat import disabled_torch_function_impl, make_wrapper_subclass, pytree


class PendingComponents:
    """What makes a DTensor subclass pending (``dtensor.AsyncDTensor``): it is made from the
    background ``Work`` computing its components, and the first read of them waits. Part of
    the DTensor class itself, it reads and defines its ``_components`` and ``_spec``."""

    @staticmethod
    def __new__(
        cls, work: background.Work, spec: DTensorSpec, *, requires_grad: bool = False
    ) -> Any:
        device = spec.mesh.device_of(spec.mesh.local_device_ids[0])
        out = new_wrapper(cls, spec, device, requires_grad)
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

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """DTensor's dispatch, except that a view (``view``, ``reshape``'s alias,
        ``transpose``...) of a DTensor whose collectives are issued on the backend and not
        waited stays unwaited, as torch's does: it is taken of the pieces as issued (torch's
        ``AsyncCollectiveTensor``s, whose views do not wait), so ``to_local()`` of the view is
        still one; the pieces wait at their first use that is not a view."""
        if args and isinstance(args[0], PendingComponents) and _is_view(func):
            unwaited = args[0]._unwaited()
            if unwaited is not None:
                args = (unwaited, *args[1:])
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _unwaited(self) -> Any:
        """The same DTensor over its pieces as issued, not pending itself (None unless its
        collectives were issued on the backend and are not waited yet)."""
        work = self.__dict__["_work"]
        if not isinstance(work, background.Issued) or work.done():
            return None
        plain = next(c for c in type(self).__mro__[1:] if not issubclass(c, PendingComponents))
        pieces = list(work.unwaited())
        out = new_wrapper(plain, self._spec, self.device, False, pieces)
        out._components = pieces
        return out

    def is_pending(self) -> bool:
        """True while the background collective has not finished."""
        work = self.__dict__["_work"]
        return work is not None and not work.done()

    def wait(self) -> Any:
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
        if isinstance(work, background.Issued):  # torch's, as issued: views stay unwaited
            return work.unwaited()[0]
        device = self.device_mesh.local_device_ids[0]
        return AsyncCollectiveTensor(
            work, 0, self._spec.local_shape(device), self.dtype, self.device_mesh.device_of(device)
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        state = "pending" if self.is_pending() else "ready"
        return f"Async{super().__repr__()[:-1]}, {state})"


def _is_view(func: Any) -> bool:
    """``func`` returns an alias of its first argument without writing it (what torch's
    ``AsyncCollectiveTensor`` leaves unwaited)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and not alias.is_write


class AsyncCollectiveTensor(torch.Tensor):
    """A plain tensor that a background collective is still computing: any op on it, and
    ``wait()``, first wait for the collective and then see the plain result."""

    __torch_function__ = disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        work: background.Work,
        index: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> AsyncCollectiveTensor:
        out = make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        out._work, out._index = work, index
        return out

    def wait(self) -> torch.Tensor:
        """The plain tensor (component ``index`` of the job's result), once it is ready."""
        return self._work.wait()[self._index]

    def is_pending(self) -> bool:
        return not self._work.done()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
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

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        state = "pending" if self.is_pending() else repr(self.wait())
        return f"AsyncCollectiveTensor({state})"


def ready(components: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``components`` with every pending one waited for (new tensor objects either way)."""
    return [c.wait() if isinstance(c, AsyncCollectiveTensor) else c.view_as(c) for c in components]
