"""The stand-in CUDA runtime (tests/fake_cudart.cpp) is as strict as CUDA where a
host-memory stand-in could hide a bug (issue 13): wrong copy directions, async copies
with pageable host memory and CPU reads of device pointers fail loudly; an event
destroyed while its record is pending is freed only once the stream passed it."""

import ctypes
import os
import signal
import subprocess
import sys
import textwrap

import pytest


H2D, D2H = 1, 2


@pytest.fixture
def rt(fake_cudart):
    lib = ctypes.CDLL(fake_cudart)
    lib.fake_cudart_malloc.restype = ctypes.c_void_p
    lib.fake_cudart_malloc.argtypes = [ctypes.c_size_t]
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    lib.fake_cudart_peek.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.fake_cudart_poke.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cudaEventDestroy.argtypes = [ctypes.c_void_p]
    lib.fake_cudart_enqueue_fill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                                             ctypes.c_int]
    return lib


def test_copy_kind_is_checked_against_device_memory(rt):
    dev = rt.fake_cudart_malloc(4096)
    host = ctypes.create_string_buffer(4096)
    assert rt.cudaHostRegister(host, 4096, 1) == 0
    try:
        assert rt.cudaMemcpyAsync(dev, host, 4096, H2D, None) == 0
        assert rt.cudaMemcpyAsync(host, dev, 4096, D2H, None) == 0
        assert rt.cudaMemcpyAsync(host, dev, 4096, H2D, None) != 0  # swapped kind
        assert rt.cudaMemcpyAsync(dev, host, 4096, D2H, None) != 0
        assert rt.cudaMemcpyAsync(dev, host, 8192, H2D, None) != 0  # past the allocation
        assert rt.cudaStreamSynchronize(None) == 0
    finally:
        assert rt.cudaHostUnregister(host) == 0


def test_async_copies_with_pageable_memory_are_refused(rt):
    dev = rt.fake_cudart_malloc(4096)
    host = ctypes.create_string_buffer(b"x" * 4096, 4096)
    assert rt.cudaMemcpyAsync(dev, host, 4096, H2D, None) != 0
    assert rt.cudaMemcpyAsync(host, dev, 4096, D2H, None) != 0
    assert rt.cudaHostRegister(host, 4096, 1) == 0
    assert rt.cudaHostRegister(host, 4096, 1) == 712  # already registered
    assert rt.cudaMemcpyAsync(dev, host, 4096, H2D, None) == 0
    assert rt.cudaStreamSynchronize(None) == 0
    back = ctypes.create_string_buffer(4096)
    assert rt.fake_cudart_peek(back, dev, 4096) == 0 and back.raw == host.raw
    assert rt.cudaHostUnregister(host) == 0
    assert rt.cudaHostUnregister(host) == 713  # not registered


def _child(code, fake, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CUDART")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), fake], capture_output=True, text=True,
                          timeout=60, env=full)


def test_cpu_reads_and_writes_of_device_memory_fault(fake_cudart):
    for op in ("ctypes.string_at(dev, 16)", "ctypes.memset(dev, 0, 16)"):
        r = _child(f"""
            import ctypes, sys
            lib = ctypes.CDLL(sys.argv[1])
            lib.fake_cudart_malloc.restype = ctypes.c_void_p
            dev = lib.fake_cudart_malloc(4096)
            print("allocated", flush=True)
            {op}
            print("survived", flush=True)
        """, fake_cudart, ASAN_OPTIONS=":".join(o for o in (os.environ.get("ASAN_OPTIONS"), "handle_segv=0") if o))
        assert "allocated" in r.stdout and "survived" not in r.stdout, (op, r.stdout, r.stderr)
        assert r.returncode == -signal.SIGSEGV, (op, r.returncode, r.stderr)


def test_pageable_copies_allowed_when_registration_is_made_to_fail(rt):
    # The engine's documented fallback (pinning failed: copies still work, slower);
    # the stand-in then copies synchronously, as CUDA does for pageable memory.
    os.environ["FAKE_CUDART_ALLOW_PAGEABLE"] = "1"  # read per call
    try:
        dev = rt.fake_cudart_malloc(4096)
        host = ctypes.create_string_buffer(b"y" * 4096, 4096)
        assert rt.cudaMemcpyAsync(dev, host, 4096, H2D, None) == 0
        back = ctypes.create_string_buffer(4096)
        assert rt.fake_cudart_peek(back, dev, 4096) == 0 and back.raw == host.raw
    finally:
        del os.environ["FAKE_CUDART_ALLOW_PAGEABLE"]


def test_event_destroyed_while_its_record_is_pending(fake_cudart):
    # CUDA frees such an event once the stream has passed it; the stand-in used to
    # free it at once while the stream thread still signalled it.
    r = _child("""
        import ctypes, sys
        lib = ctypes.CDLL(sys.argv[1])
        s, e = ctypes.c_void_p(), ctypes.c_void_p()
        lib.fake_cudart_stream_create(ctypes.byref(s))
        lib.fake_cudart_enqueue_fill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                                                 ctypes.c_int]
        lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaEventDestroy.argtypes = [ctypes.c_void_p]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        for i in range(200):
            lib.cudaEventCreateWithFlags(ctypes.byref(e), 3)
            lib.fake_cudart_enqueue_fill(s, None, 0, 0, 200)
            assert lib.cudaEventRecord(e, s) == 0
            assert lib.cudaEventDestroy(e) == 0
        assert lib.cudaStreamSynchronize(s) == 0
        print("ok", lib.fake_cudart_events_live())
    """, fake_cudart)
    assert r.returncode == 0 and r.stdout.split() == ["ok", "0"], (r.returncode, r.stdout, r.stderr)


_CAPTURE = """
    import ctypes, sys, threading
    lib = ctypes.CDLL(sys.argv[1])
    lib.cudaStreamBeginCapture.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.cudaStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.cudaStreamIsCapturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.fake_cudart_malloc.restype = ctypes.c_void_p
    lib.fake_cudart_malloc.argtypes = [ctypes.c_size_t]
    cap, other = ctypes.c_void_p(), ctypes.c_void_p()
    lib.fake_cudart_stream_create(ctypes.byref(cap))
    lib.fake_cudart_stream_create(ctypes.byref(other))

    def status():
        st = ctypes.c_int(-1)
        assert lib.cudaStreamIsCapturing(cap, ctypes.byref(st)) == 0
        return st.value

    def on_thread(mode):  # a sync of an unrelated stream from another thread in `mode`
        out = []
        def run():
            m = ctypes.c_int(mode)
            assert lib.cudaThreadExchangeStreamCaptureMode(ctypes.byref(m)) == 0
            out.append(lib.cudaStreamSynchronize(other))
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out[0]

    res = {}
    for mode, name in ((2, "relaxed"), (1, "thread_local"), (0, "global")):
        assert lib.cudaStreamBeginCapture(cap, 0) == 0  # global mode, as torch.cuda.graph
        before = status()
        rc = on_thread(mode)
        during = status()
        g = ctypes.c_void_p()
        res[name] = (before, rc, during, lib.cudaStreamEndCapture(cap, ctypes.byref(g)), bool(g.value))
    # Work queued on a capturing stream is recorded, not run.
    dev = lib.fake_cudart_malloc(4096)
    host = ctypes.create_string_buffer(b"z" * 4096, 4096)
    assert lib.cudaHostRegister(host, 4096, 1) == 0
    assert lib.cudaStreamBeginCapture(cap, 0) == 0
    assert lib.cudaMemcpyAsync(dev, host, 4096, 1, cap) == 0
    g = ctypes.c_void_p()
    assert lib.cudaStreamEndCapture(cap, ctypes.byref(g)) == 0
    back = ctypes.create_string_buffer(4096)
    lib.fake_cudart_peek.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    assert lib.fake_cudart_peek(back, dev, 4096) == 0
    res["captured"] = (lib.fake_cudart_captured(), back.raw == bytes(4096))
    print(res)
"""


def test_capture_forbids_syncs_from_other_threads_as_cuda_does(fake_cudart):
    r = _child(_CAPTURE, fake_cudart)
    assert r.returncode == 0, r.stderr
    res = eval(r.stdout.strip().splitlines()[-1])  # a dict of tuples printed by the child
    # (status before, the other thread's sync, status after, cudaStreamEndCapture, a graph came back)
    assert res["relaxed"] == (1, 0, 1, 0, True)
    assert res["thread_local"] == (1, 0, 1, 0, True)  # only its own captures bind a thread-local thread
    assert res["global"] == (1, 900, 2, 901, False)  # cudaErrorStreamCaptureUnsupported, then Invalidated
    assert res["captured"] == (1, True)  # the copy was recorded, the device memory untouched
