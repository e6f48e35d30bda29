"""What differs between transformers releases in the continuous-batching API: detected, in one place.

Everything of transformers CB that cbverify touches and that changed between 5.8 and 5.24, read in each release's
``generation/configuration_utils.py`` and ``generation/continuous_batching/``:

- the page size is ``ContinuousBatchingConfig.block_size`` up to 5.17 and ``page_size`` from 5.18 (where
  ``block_size`` stays as a deprecated alias);
- ``seed`` exists from 5.9 (the manager then calls ``torch.manual_seed(seed)`` when it is built; before, it samples
  from whatever state torch's global RNG is in, so a caller seeds that itself);
- ``max_requests_per_batch`` exists from 5.11;
- a dead generation thread's error is ``manager.fatal_error`` up to 5.16 (5.10 to 5.16 also have a
  ``background_thread_status`` without it) and ``manager.background_thread_status.fatal_error`` in later releases;
  ``manager.destroy()`` exists from 5.10;
- an eviction is ``OffloadingManager.offload_one_request()`` up to 5.12 and ``offload_requests()`` from 5.13
  (returning how many it evicted up to 5.17, a bool from 5.18 that is also True when only finished requests' cached
  blocks were dropped);
- ``manager.pause()`` (a context manager holding the generation loop while the caller changes the model) exists from
  5.18.

``model.generate_batch`` (the entry point TRL calls) is read off its signature (:data:`BATCH_PARAMETERS`): a keyword
the installed release does not name is refused by :func:`batch_kwargs` (``persistent_manager``, ``warmup``, ...);
``destroy_cached_manager`` drops the manager a ``persistent_manager=True`` call cached on the model; the defaults a
``GenerationConfig`` field left unset takes (:func:`generation_defaults`) are the release's own table.

Read off every minor release's newest patch (``cbverify matrix --all-minors 5.8`` builds them all). transformers 4.x
(which ``cbverify matrix`` installs beside trl 0.14 to 0.28) has no ``ContinuousBatchingConfig``: this module still
imports there, and everything that drives continuous batching is refused through :func:`require`, naming the release.

Callers use the current names (``page_size``, ...). A field the installed release does not have is refused with
:class:`MissingFeature`, naming the release, unless its value is the library default (``None``): never silently
dropped. Nothing here is a private API that is not checked for first.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import transformers

VERSION = transformers.__version__
try:
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
except ImportError:  # transformers 4.x (beside trl before 0.29): its generate_batch takes no configuration object
    ContinuousBatchingConfig = ContinuousBatchingManager = None
# why the installed release has no continuous batching this layer can drive, or None
ABSENT: str | None = (f"transformers {VERSION} has no ContinuousBatchingConfig (continuous batching with a "
                      "configuration: 5.x)") if ContinuousBatchingConfig is None else None  # fmt: skip
FIELDS = frozenset(ContinuousBatchingConfig.__dataclass_fields__) if ContinuousBatchingConfig else frozenset()
PAGE_FIELD = "page_size" if "page_size" in FIELDS else "block_size"
DEFAULT_PAGE_SIZE: int | None = (ContinuousBatchingConfig.__dataclass_fields__[PAGE_FIELD].default
                                 if ContinuousBatchingConfig else None)  # fmt: skip
CAN_PAUSE: bool = hasattr(ContinuousBatchingManager, "pause")


class MissingFeature(ValueError):
    """The installed transformers lacks a continuous-batching option that was asked for."""


def require() -> None:
    """Refuse (:class:`MissingFeature`, naming the release) where the installed transformers has no
    ``ContinuousBatchingConfig`` at all (4.x)."""
    if ABSENT is not None:
        raise MissingFeature(ABSENT)


def has(field: str) -> bool:
    """Whether the installed ``ContinuousBatchingConfig`` takes ``field`` (current name)."""
    return (PAGE_FIELD if field == "page_size" else field) in FIELDS


def config_kwargs(**options) -> dict:
    """``ContinuousBatchingConfig`` keyword arguments for the installed release, from current names."""
    require()
    out = {}
    for name, value in options.items():
        installed = PAGE_FIELD if name == "page_size" else name
        if installed in FIELDS:
            out[installed] = value
        elif value is not None:
            raise MissingFeature(f"transformers {VERSION}: ContinuousBatchingConfig has no {name!r} (asked {value!r})")
    return out


def init_manager(model, generation_config, **options):
    """``model.init_continuous_batching`` with ``options`` (current names)."""
    kwargs = config_kwargs(**options)
    return model.init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=ContinuousBatchingConfig(**kwargs)
    )


def fatal_error(manager) -> BaseException | None:
    """The exception that killed the manager's generation thread, if any (on the manager itself or on its
    ``background_thread_status``, depending on the release: both are looked at)."""
    for holder in (getattr(manager, "background_thread_status", None), manager):
        if getattr(holder, "fatal_error", None) is not None:
            return holder.fatal_error
    return None


def destroy(manager) -> None:
    """Release a stopped manager's resources where the release has ``destroy()`` (5.10+)."""
    if hasattr(manager, "destroy"):
        manager.destroy()


@contextmanager
def count_evictions():
    """Count eviction events (a request offloaded to CPU or soft-reset to be re-prefilled) while the block runs.

    Yields a one-item list. Up to 5.12 every ``offload_one_request()`` call is one event; from 5.13 a call of
    ``offload_requests()`` that evicted anything is one (it may evict several requests at once)."""
    from transformers.generation.continuous_batching import offloading_manager as om

    counter = [0]
    cls = om.OffloadingManager
    name = "offload_requests" if hasattr(cls, "offload_requests") else "offload_one_request"
    original = getattr(cls, name)

    def counted(this, *args, **kwargs):
        starved = bool(getattr(getattr(this, "scheduler", None), "starved_requests", True))
        done = original(this, *args, **kwargs)
        # offload_one_request returns None; offload_requests an int (5.13-5.17) or a bool that is also True when
        # only cached (finished) blocks were dropped (5.18+), hence the starved check
        counter[0] += 1 if name == "offload_one_request" else int(bool(done) and starved)
        return done

    setattr(cls, name, counted)
    try:
        yield counter
    finally:
        setattr(cls, name, original)


def _batch_parameters() -> frozenset[str]:
    from transformers.generation.utils import GenerationMixin

    batch = getattr(GenerationMixin, "generate_batch", None)
    return frozenset(inspect.signature(batch).parameters) - {"self", "kwargs"} if batch else frozenset()


BATCH_PARAMETERS: frozenset[str] = _batch_parameters()  # generate_batch's named parameters ({} if it has none)


def batch_kwargs(**options) -> dict:
    """``generate_batch`` keyword arguments for the installed release: a named parameter it lacks is refused with
    :class:`MissingFeature` (naming the release) unless its value is the default (``None`` / ``False``)."""
    require()
    if not BATCH_PARAMETERS:
        raise MissingFeature(f"transformers {VERSION}: no generate_batch")
    out = {}
    for name, value in options.items():
        if name in BATCH_PARAMETERS:
            out[name] = value
        elif value not in (None, False):
            raise MissingFeature(f"transformers {VERSION}: generate_batch has no {name!r} (asked {value!r})")
    return out


def cached_manager(model):
    """The manager a ``generate_batch(persistent_manager=True)`` call left cached on ``model``, or ``None``."""
    return getattr(model, "_cached_continuous_batching_manager", None)


def destroy_cached_manager(model) -> None:
    """Drop the manager a ``generate_batch(persistent_manager=True)`` call cached on ``model`` (stopping it)."""
    if hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()
    elif getattr(model, "_cached_continuous_batching_manager", None) is not None:  # a release without the method
        manager = model._cached_continuous_batching_manager
        if manager.is_running():
            manager.stop(block=True)
        destroy(manager)
        del model._cached_continuous_batching_manager


def generation_defaults() -> dict:
    """What a ``GenerationConfig`` field left unset (``None``) takes in ``generate()``, by the installed release's own
    rule: its ``_get_default_generation_params()`` table where it has one (the class docstring names it), else the
    values a bare ``GenerationConfig()`` carries (releases whose constructor still filled the defaults in)."""
    from transformers import GenerationConfig

    table = getattr(GenerationConfig, "_get_default_generation_params", None)
    return dict(table()) if table is not None else GenerationConfig().to_dict()
