"""The GPU's SM clock, power and temperature while a benchmark runs, sampled through NVML (the
driver's ``libnvidia-ml.so.1``, called with ctypes: no Python package needed) on a background thread,
and summarised per labelled time window.

Why: two paths that run the same GEMM kernels on the same shapes can still differ in those kernels'
time when the GPU runs them at different clocks (a power- or heat-capped GPU lowers its clock under a
denser load). The benchmark's windows are its timed steps, so each path gets the clocks its own steps
ran at.

    s = ClockSampler(torch.device("cuda", 0))   # None-safe: .ok is False where NVML is missing
    s.start()
    t0 = time.perf_counter(); ...; s.window("verl_ops", t0, time.perf_counter())
    s.stop(); s.summary()  # {"verl_ops": {"samples": n, "sm_mhz": mean, "sm_mhz_min": .., "power_w": ..,
                           #  "temp_c": ..}, "_device": {"sm_mhz_max": the clock's maximum}}
"""
from __future__ import annotations

import ctypes
import statistics
import threading
import time

_NVML_CLOCK_SM = 1
_NVML_TEMPERATURE_GPU = 0


class ClockSampler:
    def __init__(self, device=None, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.samples = []  # (perf_counter, sm MHz, power W, temperature C)
        self.windows = []  # (label, t0, t1)
        self.ok, self.why = False, ""
        self._stop = threading.Event()
        self._thread = None
        self._max_mhz = None
        try:
            self._nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if self._nvml.nvmlInit_v2() != 0:
                raise OSError("nvmlInit_v2 failed")
            self._handle = ctypes.c_void_p()
            got = -1
            bus = _pci_bus_id(device)
            if bus is not None:
                try:
                    got = self._nvml.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(self._handle))
                except AttributeError:
                    got = -1
            if got != 0:
                index = device.index if device is not None and device.index is not None else 0
                got = self._nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._handle))
            if got != 0:
                raise OSError(f"no NVML handle for the device (error {got})")
            mhz = ctypes.c_uint()
            if self._nvml.nvmlDeviceGetMaxClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(mhz)) == 0:
                self._max_mhz = int(mhz.value)
            self.ok = self._read() is not None
            if not self.ok:
                self.why = "NVML returned no clock"
        except (OSError, AttributeError) as e:
            self.why = f"NVML unavailable: {e}"

    def _read(self):
        mhz, mw, temp = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        if self._nvml.nvmlDeviceGetClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(mhz)) != 0:
            return None
        power = mw.value / 1e3 if self._nvml.nvmlDeviceGetPowerUsage(self._handle, ctypes.byref(mw)) == 0 else None
        t = temp.value if self._nvml.nvmlDeviceGetTemperature(
            self._handle, _NVML_TEMPERATURE_GPU, ctypes.byref(temp)) == 0 else None
        return int(mhz.value), power, t

    def _run(self):
        while not self._stop.is_set():
            r = self._read()
            if r is not None:
                self.samples.append((time.perf_counter(), *r))
            self._stop.wait(self.interval_s)

    def start(self):
        if self.ok and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu_clocks", daemon=True)
            self._thread.start()
        return self

    def stop(self):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def window(self, label: str, t0: float, t1: float) -> None:
        """Samples taken between perf_counter times t0 and t1 count for ``label``."""
        self.windows.append((label, t0, t1))

    def summary(self) -> dict:
        return summarize(self.samples, self.windows, self._max_mhz)


def summarize(samples, windows, max_mhz=None) -> dict:
    """Per label: the number of samples inside its windows and their mean SM clock (and its minimum),
    power and temperature. ``samples``: (time, MHz, W or None, C or None), time-ordered."""
    per = {}
    times = [s[0] for s in samples]
    import bisect

    for label, t0, t1 in windows:
        lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
        per.setdefault(label, []).extend(samples[lo:hi])
    out = {}
    for label, got in per.items():
        mhz = [s[1] for s in got]
        watts = [s[2] for s in got if s[2] is not None]
        temps = [s[3] for s in got if s[3] is not None]
        out[label] = {
            "samples": len(got),
            "sm_mhz": statistics.fmean(mhz) if mhz else None,
            "sm_mhz_min": min(mhz) if mhz else None,
            "power_w": statistics.fmean(watts) if watts else None,
            "temp_c": statistics.fmean(temps) if temps else None,
        }
    out["_device"] = {"sm_mhz_max": max_mhz}
    return out


def _pci_bus_id(device):
    """NVML's bus id string for a torch CUDA device ("00000000:1B:00.0"), or None."""
    try:
        import torch

        if device is None or device.type != "cuda":
            return None
        p = torch.cuda.get_device_properties(device)
        return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
    except Exception:  # noqa: BLE001  (older torch without the fields)
        return None
