"""launch's shim for Python workers: hang forensics for unchanged PyTorch scripts.

`launch` puts this file's folder first on the PYTHONPATH of the Python workers it starts (a
script, -m, or the python given after --), so Python's site module imports it at start-up, and
then it:

- chains to the sitecustomize that would have run without it (the next one on sys.path: the
  distribution's, a virtualenv's, the user's), as ddtrace-run and opentelemetry-instrument do;
- never imports torch: a post-import hook on sys.meta_path patches torch.distributed when the
  script imports it, so a script without torch pays one dict lookup per import it makes;
- when $LAUNCH_COLLECTIVE_RING is set (the agent's stall watch, agent/stall_watch.h), takes that
  ring for this process (the variable is removed from os.environ, so processes the worker starts,
  DataLoader workers among them, never write to it) and, at init_process_group, creates the file
  in the layout base/collective_ring.h defines, written through ctypes on an mmap;
- records torch.distributed's collectives in it (all_reduce, broadcast, all_gather(_into_tensor),
  reduce_scatter(_tensor), reduce, gather, scatter, all_to_all(_single), barrier; async_op=True
  completes when the work's future does) and DDP's gradient all-reduces through a comm hook
  (DistributedDataParallel's C++ Reducer issues those without Python: a recording all-reduce hook
  when the user registers none, the user's own wrapped when they do);
- answers the agent's stack-dump signal with faulthandler's dump of every Python thread
  (liblaunch-pystack.so, pystack.c, says why faulthandler needs that helper).

Any failure in here prints one warning ("launch: warning: python shim: ...") and leaves the
script as it would run without launch. LAUNCH_PYTHON_SHIM=0 (launch's --python_shim false) keeps
launch from installing it.

Ring writes: every field is one aligned store of its width (single-copy atomic on x86-64 and
AArch64), in the order the C++ writer uses (base/collective_ring.cc), under one lock (completions
come from the backend's threads). Without the C++ writer's fences, the order is what another core
sees only on x86-64 (TSO), where the reader's seqlock on each slot's stamp then catches a slot being
rewritten; on a weakly ordered CPU a report may show a torn entry, never more.
"""

import os
import sys

_SHIM_DIR = os.path.dirname(os.path.abspath(__file__))
_WARNED = []


def _warn(what):
    """One warning per process, whatever fails afterwards."""
    if _WARNED:
        return
    _WARNED.append(what)
    try:
        sys.stderr.write("launch: warning: python shim: %s\n" % what)
        sys.stderr.flush()
    except Exception:
        pass


def _enabled():
    # The same spellings as launch's boolean settings (config/scalars.cc).
    value = os.environ.get("LAUNCH_PYTHON_SHIM", "").strip().lower()
    return value not in ("0", "false", "no", "off")


# --- The ring (base/collective_ring.h) ----------------------------------------------------------

_RING_CAPACITY = 64  # kRingCapacity
_RING_GROUPS = 8  # kRingGroups
_RING_GROUP_NAME = 32  # kRingGroupName, NUL included
_RING_MAGIC = 0x474E495248434E4C  # "LNCHRING", little-endian
_RING_VERSION = 1
_RING_SIZE = 3968  # sizeof(CollectiveRing::Layout) on x86-64 and AArch64

# CollectiveOp and CollectiveState.
ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, BARRIER = 1, 2, 3, 4, 5
REDUCE, GATHER, SCATTER, ALL_TO_ALL = 6, 7, 8, 9
ENQUEUED, STARTED, DONE, FAILED = 1, 2, 3, 4


def _layout_types():
    import ctypes

    u32, i32, u64, i64 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64

    class Group(ctypes.Structure):
        _fields_ = [("last_seq", u64), ("name", ctypes.c_char * _RING_GROUP_NAME)]

    class Slot(ctypes.Structure):
        _fields_ = [("stamp", u64), ("op", u32), ("group", i32), ("seq", u64), ("bytes", i64),
                    ("enqueued_ns", u64), ("done_ns", u64), ("state", u32)]

    class Layout(ctypes.Structure):
        _fields_ = [("magic", u64), ("version", u32), ("capacity", u32), ("pid", i32),
                    ("rank", i32), ("issued", u64), ("completed", u64), ("last_done_ns", u64),
                    ("created_ns", u64), ("group_count", u32), ("groups", Group * _RING_GROUPS),
                    ("slots", Slot * _RING_CAPACITY)]

    if ctypes.sizeof(Layout) != _RING_SIZE:
        raise RuntimeError("ring layout is %d bytes, the agent reads %d"
                           % (ctypes.sizeof(Layout), _RING_SIZE))
    return Layout


class Ring:
    """A collective ring file written by this process (CollectiveRing's Python twin)."""

    def __init__(self, path, rank):
        import mmap
        import threading
        import time

        self.path = path
        self._now = time.monotonic_ns  # CLOCK_MONOTONIC, the ring's time base
        self._lock = threading.Lock()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            os.ftruncate(fd, _RING_SIZE)
            self._map = mmap.mmap(fd, _RING_SIZE, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        layout = _layout_types().from_buffer(self._map)
        self._layout = layout
        self._slots = [layout.slots[i] for i in range(_RING_CAPACITY)]
        self._groups = {}  # name -> index
        # A fresh file is zero; the magic goes last, as the C++ writer does.
        layout.version = _RING_VERSION
        layout.capacity = _RING_CAPACITY
        layout.pid = os.getpid()
        layout.rank = rank
        layout.created_ns = self._now()
        layout.magic = _RING_MAGIC

    def group(self, name):
        """The index of group `name` (registered on first use); -1 when the table is full."""
        index = self._groups.get(name)
        if index is not None:
            return index
        with self._lock:
            layout = self._layout
            n = layout.group_count
            if n >= _RING_GROUPS:
                return -1
            layout.groups[n].name = name.encode("utf-8", "replace")[:_RING_GROUP_NAME - 1]
            layout.group_count = n + 1  # after the name: a reader counts only named groups
            self._groups[name] = n
            return n

    def begin(self, group, op, nbytes, state):
        """Records an operation's start; returns its token for done() (0: not recorded)."""
        if group < 0:
            return 0
        with self._lock:
            layout = self._layout
            g = layout.groups[group]
            seq = g.last_seq + 1
            g.last_seq = seq
            index = layout.issued
            layout.issued = index + 1
            s = self._slots[index % _RING_CAPACITY]
            s.stamp = 0  # the reader leaves the slot out until the stamp is back
            s.op = op
            s.group = group
            s.seq = seq
            s.bytes = nbytes
            s.enqueued_ns = self._now()
            s.done_ns = 0
            s.state = state
            s.stamp = index + 1
            return index + 1

    def done(self, token, ok=True):
        if token == 0:
            return
        with self._lock:
            now = self._now()
            s = self._slots[(token - 1) % _RING_CAPACITY]
            # A slot reused meanwhile holds another operation's record.
            if s.stamp == token:
                s.done_ns = now
                s.state = DONE if ok else FAILED
            layout = self._layout
            layout.completed = layout.completed + 1
            layout.last_done_ns = now


# --- Stack dumps --------------------------------------------------------------------------------

def _install_stack_dump(stack_path):
    """faulthandler's dump of every thread, on the agent's signal, into `stack_path`.

    Always registered, whether or not the user enabled faulthandler (PYTHONFAULTHANDLER, -X
    faulthandler): that switch installs handlers for fatal signals (SIGSEGV, SIGABRT, ...), which
    change what a crash prints; this one is for a real-time signal nothing else uses, which only
    the agent sends (on a stall or `kill -URG` to launch), and it only writes a file.
    """
    import ctypes
    import faulthandler
    import signal

    lib = ctypes.CDLL(os.path.join(os.path.dirname(_SHIM_DIR), "liblaunch-pystack.so"),
                      use_errno=True)
    signo = lib.launch_pystack_signal()
    # faulthandler restores the handler it found when the interpreter finalizes: make that "ignore"
    # (a request during shutdown is dropped), never the default action, which is to die.
    signal.signal(signo, signal.SIG_IGN)
    null_fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)  # faulthandler keeps it open
    faulthandler.register(signo, file=null_fd, all_threads=True, chain=False)
    lib.launch_pystack_install.argtypes = [ctypes.c_char_p, ctypes.c_int]
    if lib.launch_pystack_install(os.fsencode(stack_path), null_fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "cannot install the stack-dump handler: " + os.strerror(err))


# --- Recording torch.distributed ----------------------------------------------------------------

class _State:
    ring_path = None  # taken from $LAUNCH_COLLECTIVE_RING when torch.distributed is imported
    ring = None  # Ring, from init_process_group on; None in a forked child
    world = None  # the default process group, recorded as 'world'
    c10d = None
    all_reduce = None  # the original torch.distributed.all_reduce
    groups = {}  # ProcessGroup -> ring group index


_S = _State()


def _local():
    import threading

    class Local(threading.local):
        depth = 0  # > 0 inside a recorded operation: nested collectives are part of it

    return Local()


_TLS = _local()


def _ring_group(group):
    """The ring's index for torch's process group `group` (None: the default group)."""
    if group is None or group is _S.world:
        key, name = None, "world"
    elif group is getattr(_S.c10d.GroupMember, "NON_GROUP_MEMBER", None):
        return -1  # torch does nothing on a rank outside the group: neither do we
    else:
        index = _S.groups.get(group)
        if index is not None:
            return index
        key = group
        name = getattr(group, "group_name", None)  # PyTorch 2.x
        if not isinstance(name, str):
            name = getattr(_S.c10d, "_pg_names", {}).get(group, "group")  # 1.13
        if name == "world":
            name = "group world"
    index = _S.groups.get(key)
    if index is None:
        index = _S.ring.group(name)
        _S.groups[key] = index
    return index


def _nbytes(value):
    if value is None:
        return 0
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return value.numel() * value.element_size()


class _Callbacks:
    """The callbacks the shim hands to torch futures, until the backend drops them.

    PyTorch runs a future's Python callback on the backend's thread (Gloo's worker), and drops
    its reference to it (taking the GIL) just after completing the future. A script that returns
    from its last collective and exits can reach interpreter finalization in between; the worker
    thread then blocks for the GIL in a finalizing interpreter, which ends it with pthread_exit
    from inside C++ code that cannot unwind: std::terminate, SIGABRT (PyTorch 1.13 does the
    same with its own Python comm hooks). So every callback is tracked by a weak reference, and
    an atexit handler (which runs before finalization) waits for those still held."""

    def __init__(self):
        self.pending = set()
        # A comm hook of the user's puts callbacks of its own on torch futures (PyTorch's
        # default_hooks do: a then()), which are released after the shim's, untracked.
        self.foreign = False

    def track(self, fn):
        import weakref

        self.pending.add(weakref.ref(fn, self.pending.discard))
        return fn

    def drain(self, timeout_s=2.0):
        import time

        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.001)  # releases the GIL: the backend thread can let go
        if self.foreign:
            time.sleep(0.05)  # their release follows ours within microseconds: a margin for it


_CALLBACKS = _Callbacks()


def _future_ok(fut):
    try:
        fut.value()
        return True
    except Exception:
        return False


def _recorded(fn, op, data_arg):
    """`fn` (a torch.distributed collective) recording each call in the ring."""
    import functools
    import inspect

    params = list(inspect.signature(fn).parameters)
    group_at = params.index("group")
    async_at = params.index("async_op")
    data_at = params.index(data_arg) if data_arg else -1

    def arg(args, kwargs, name, at, default):
        if name in kwargs:
            return kwargs[name]
        return args[at] if 0 <= at < len(args) else default

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ring = _S.ring
        if ring is None or _TLS.depth:
            return fn(*args, **kwargs)
        try:
            group = _ring_group(arg(args, kwargs, "group", group_at, None))
            async_op = bool(arg(args, kwargs, "async_op", async_at, False))
            nbytes = _nbytes(arg(args, kwargs, data_arg, data_at, None)) if data_arg else 0
        except Exception:
            return fn(*args, **kwargs)  # arguments torch will reject: its error, not ours
        token = ring.begin(group, op, nbytes, ENQUEUED if async_op else STARTED)
        _TLS.depth += 1
        try:
            work = fn(*args, **kwargs)
        except BaseException:
            ring.done(token, False)
            raise
        finally:
            _TLS.depth -= 1
        if async_op and work is not None:
            try:
                work.get_future().add_done_callback(
                    _CALLBACKS.track(lambda f: ring.done(token, _future_ok(f))))
            except Exception:
                ring.done(token)  # a backend without futures: counted as done once issued
        else:
            ring.done(token)
        return work

    return wrapper


# (name, op, the argument whose bytes are recorded). The bytes are what every rank of a correct
# program has alike (the desync check compares them), except for all-to-all's, which may differ.
_COLLECTIVES = [
    ("all_reduce", ALL_REDUCE, "tensor"),
    ("broadcast", BROADCAST, "tensor"),
    ("all_gather", ALL_GATHER, "tensor_list"),
    ("all_gather_into_tensor", ALL_GATHER, "output_tensor"),
    ("_all_gather_base", ALL_GATHER, "output_tensor"),
    ("reduce_scatter", REDUCE_SCATTER, "output"),
    ("reduce_scatter_tensor", REDUCE_SCATTER, "output"),
    ("_reduce_scatter_base", REDUCE_SCATTER, "output"),
    ("reduce", REDUCE, "tensor"),
    ("gather", GATHER, "tensor"),
    ("scatter", SCATTER, "tensor"),
    ("all_to_all", ALL_TO_ALL, "input_tensor_list"),
    ("all_to_all_single", ALL_TO_ALL, "input"),
    ("barrier", BARRIER, None),
]


def _start_ring(c10d):
    """After init_process_group: the ring and the stack handler (once per process)."""
    _S.world = c10d._get_default_group()
    _S.groups = {}
    if _S.ring is not None or _S.ring_path is None:
        return
    path, _S.ring_path = _S.ring_path, None
    try:
        try:
            _install_stack_dump(path + ".stack")  # before the ring names this pid to the agent
        except Exception as e:
            # The ring still tells who waits where; the report says this rank gave no stack.
            _warn("no Python stacks in hang reports (%s)" % e)
        _S.ring = Ring(path, c10d.get_rank())
        os.register_at_fork(after_in_child=lambda: setattr(_S, "ring", None))
        import atexit

        atexit.register(_CALLBACKS.drain)
    except Exception as e:
        _warn("no collective ring %s (%s): hang reports will lack this rank" % (path, e))


def _patch_c10d(c10d):
    """Runs once torch.distributed.distributed_c10d has executed, before torch.distributed's
    own `from .distributed_c10d import *` copies its names."""
    _S.ring_path = os.environ.pop("LAUNCH_COLLECTIVE_RING", None) or None
    if _S.ring_path is None:
        return  # not under launch's stall watch: torch stays as it is
    _S.c10d = c10d
    _S.all_reduce = c10d.all_reduce
    wrapped = {}
    for name, op, data_arg in _COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is not None:
            wrapped[name] = _recorded(fn, op, data_arg)
    init = c10d.init_process_group

    def init_process_group(*args, **kwargs):
        result = init(*args, **kwargs)
        _start_ring(c10d)
        return result

    import functools

    wrapped["init_process_group"] = functools.wraps(init)(init_process_group)
    # Only once everything is built: a failure above leaves torch untouched.
    for name, fn in wrapped.items():
        setattr(c10d, name, fn)


# --- DistributedDataParallel --------------------------------------------------------------------

class _DdpHook:
    """The comm hook state launch registers on a DDP model: records each bucket's all-reduce.

    Without a hook of the user's, it does what the Reducer's built-in all-reduce does: the
    gradients times 1/world size (the built-in multiplies as it copies them into the bucket),
    summed over the group. A hook the user registers later runs in its place, recorded."""

    def __init__(self, ddp):
        self.group = ddp.process_group
        self.scale = 1.0 / self.group.size()
        self.user = None  # (state, hook) once the user registers one


def _record_user_hook(group, state, hook, bucket):
    ring = _S.ring
    if ring is None:
        return hook(state, bucket)
    _CALLBACKS.foreign = True
    token = ring.begin(_ring_group(group), ALL_REDUCE, _nbytes(bucket.buffer()), ENQUEUED)
    _TLS.depth += 1  # the hook's own collectives are this record's parts
    try:
        fut = hook(state, bucket)
    except BaseException:
        ring.done(token, False)
        raise
    finally:
        _TLS.depth -= 1
    fut.add_done_callback(_CALLBACKS.track(lambda f: ring.done(token, _future_ok(f))))
    return fut


def _launch_allreduce_hook(state, bucket):
    if state.user is not None:
        return _record_user_hook(state.group, state.user[0], state.user[1], bucket)
    ring = _S.ring
    buf = bucket.buffer()
    buf.mul_(state.scale)
    token = ring.begin(_ring_group(state.group), ALL_REDUCE, _nbytes(buf),
                       ENQUEUED) if ring else 0
    fut = _S.all_reduce(buf, group=state.group, async_op=True).get_future()

    def reduced(f):
        try:
            value = f.value()[0]
        except BaseException:
            if ring:
                ring.done(token, False)
            raise
        if ring:
            ring.done(token)
        return value

    return fut.then(_CALLBACKS.track(reduced))


def _patch_ddp(module):
    if _S.ring_path is None and _S.c10d is None:
        return  # torch.distributed was not patched: DDP stays as it is
    import functools

    ddp_class = module.DistributedDataParallel
    init = ddp_class.__init__
    register = ddp_class.register_comm_hook
    builtin = getattr(ddp_class, "_register_builtin_comm_hook", None)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # DDP's own __init__ may have registered a hook (mixed precision in 2.x): recorded.
        if _S.ring is None or "_launch_hook" in self.__dict__:
            return
        try:
            state = _DdpHook(self)
            register(self, state, _launch_allreduce_hook)
            self.__dict__["_launch_hook"] = state
        except Exception as e:
            _warn("DDP's gradient all-reduces are not recorded (%s)" % e)

    @functools.wraps(register)
    def register_comm_hook(self, state, hook):
        ours = self.__dict__.get("_launch_hook")
        if isinstance(ours, _DdpHook):
            if ours.user is not None:
                raise RuntimeError(
                    "register_comm_hook or register_builtin_comm_hook can only be called once.")
            check = getattr(self, "_check_comm_hook", None)
            if check is not None:
                check(hook)
            ours.user = (state, hook)
            try:
                self.logger._set_comm_hook_name(hook.__qualname__)
            except Exception:
                pass
            return None
        if _S.ring is None:
            return register(self, state, hook)
        check = getattr(self, "_check_comm_hook", None)
        if check is not None:
            check(hook)
        group = self.process_group

        @functools.wraps(hook)
        def recorded(state, bucket):
            return _record_user_hook(group, state, hook, bucket)

        self.__dict__["_launch_hook"] = "user"
        return register(self, state, recorded)

    patched = {"__init__": __init__, "register_comm_hook": register_comm_hook}
    if builtin is not None:
        @functools.wraps(builtin)
        def _register_builtin_comm_hook(self, comm_hook_type):
            ours = self.__dict__.get("_launch_hook")
            if not isinstance(ours, _DdpHook):
                return builtin(self, comm_hook_type)
            # The built-in hooks' Python twins (default_hooks.py), recorded like any hook.
            from torch.distributed import BuiltinCommHookType
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            twins = {BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                     BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
            if comm_hook_type not in twins:
                return builtin(self, comm_hook_type)  # torch's own error
            return register_comm_hook(self, self.process_group, twins[comm_hook_type])

        patched["_register_builtin_comm_hook"] = _register_builtin_comm_hook
    for name, fn in patched.items():
        setattr(ddp_class, name, fn)


# --- The post-import hook -----------------------------------------------------------------------

class _PostImportHooks:
    """A sys.meta_path finder that runs hooks[name](module) right after module `name` executes.

    It finds nothing itself: it asks the other finders for the spec and wraps its loader's
    exec_module for that one call (the loader, hence module.__loader__, stays torch's own)."""

    def __init__(self, hooks):
        self._hooks = dict(hooks)
        self._busy = set()

    def find_spec(self, fullname, path=None, target=None):
        hook = self._hooks.get(fullname)
        if hook is None or fullname in self._busy:
            return None
        import importlib.util

        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:
            return None
        finally:
            self._busy.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        self._hooks.pop(fullname)
        if not self._hooks:
            self.remove()
        exec_module = loader.exec_module

        def exec_and_hook(module):
            try:
                exec_module(module)
            finally:
                try:
                    del loader.exec_module
                except AttributeError:
                    pass
            try:
                hook(module)
            except Exception as e:
                _warn("cannot patch %s (%s): its collectives are not recorded" % (fullname, e))

        try:
            loader.exec_module = exec_and_hook
        except Exception:
            return None
        return spec

    def remove(self):
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def _install():
    hooks = {"torch.distributed.distributed_c10d": _patch_c10d,
             "torch.nn.parallel.distributed": _patch_ddp}
    for name in list(hooks):
        if name in sys.modules:  # imported before site ran: nothing to patch safely
            hooks.pop(name)
    if hooks:
        sys.meta_path.insert(0, _PostImportHooks(hooks))


def _chain():
    """Runs the sitecustomize this one hides: the next on sys.path. Its errors are its own, as
    without launch (site prints them)."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _SHIM_DIR]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # `import sitecustomize` gives the user's
    spec.loader.exec_module(module)


if _enabled():
    try:
        _install()
    except Exception as e:
        _warn("not installed (%s): the script runs without hang forensics" % e)
_chain()
