"""The GPU's SM clock, energy and temperature while a benchmark runs, sampled through NVML (the
driver's ``libnvidia-ml.so.1``, called with ctypes: no Python package needed) on a background thread,
and summarised per labelled time window.

Why: two paths that run the same GEMM kernels on the same shapes can still differ in those kernels'
time when the GPU runs them at different clocks (a power- or heat-capped GPU lowers its clock under a
denser load). The benchmark's windows are its timed steps, so each path gets the clocks its own steps
ran at.

Power comes from the GPU's energy counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ since the
driver loaded), not from ``nvmlDeviceGetPowerUsage``: on Ampere and newer that one is a one-second
average, longer than a step, so it would mix the paths of neighbouring steps. A window's energy is
the counter's difference between the first and the last sample inside it, scaled to the window's
length; its mean power is that difference over the time between those samples.

    s = ClockSampler(torch.device("cuda", 0)).start()   # .ok is False where NVML is missing
    t0 = time.perf_counter(); ...; s.window("verl_ops", t0, time.perf_counter())
    s.stop(); s.summary()  # {"verl_ops": {"samples", "sm_mhz", "sm_mhz_min", "power_w", "energy_j",
                           #  "temp_c"}, "_device": {"sm_mhz_max": the clock's maximum}}
"""
from __future__ import annotations

import bisect
import ctypes
import os
import statistics
import threading
import time

_NVML_CLOCK_SM = 1
_NVML_TEMPERATURE_GPU = 0


class ClockSampler:
    def __init__(self, device=None, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.samples = []  # (perf_counter, sm MHz, energy mJ or None, temperature C or None)
        self.windows = []  # (label, t0, t1)
        self.ok, self.why = False, ""
        self._stop = threading.Event()
        self._thread = None
        self._max_mhz = None
        if device is None or getattr(device, "type", None) != "cuda":
            self.why = "not a CUDA device"
            return
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
            if got != 0 and not os.environ.get("CUDA_VISIBLE_DEVICES"):
                # (NVML's index is the CUDA index only when no device is hidden or reordered)
                index = device.index if device.index is not None else 0
                got = self._nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._handle))
            if got != 0:
                raise OSError(f"no NVML handle for {device} (error {got})")
            mhz = ctypes.c_uint()
            if self._nvml.nvmlDeviceGetMaxClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(mhz)) == 0:
                self._max_mhz = int(mhz.value)
            self.ok = self._read() is not None
            if not self.ok:
                self.why = "NVML returned no clock"
        except (OSError, AttributeError) as e:
            self.why = f"NVML unavailable: {e}"

    def _read(self):
        mhz, mj, temp = ctypes.c_uint(), ctypes.c_ulonglong(), ctypes.c_uint()
        if self._nvml.nvmlDeviceGetClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(mhz)) != 0:
            return None
        energy = int(mj.value) if self._nvml.nvmlDeviceGetTotalEnergyConsumption(
            self._handle, ctypes.byref(mj)) == 0 else None
        t = int(temp.value) if self._nvml.nvmlDeviceGetTemperature(
            self._handle, _NVML_TEMPERATURE_GPU, ctypes.byref(temp)) == 0 else None
        return int(mhz.value), energy, t

    def _run(self):
        while not self._stop.is_set():
            r = self._read()
            if r is not None:
                self.samples.append((time.perf_counter(), *r))
            self._stop.wait(self.interval_s)

    def start(self):
        if self.ok and self._thread is None:
            self._stop.clear()
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
    """Per label, over the samples inside its windows: their number, mean SM clock and its minimum,
    mean temperature, and from the energy counter the mean power (W) and the energy per window (J,
    the mean over windows with two samples or more). ``samples``: (time s, MHz, energy mJ or None,
    C or None), time-ordered."""
    times = [s[0] for s in samples]
    per = {}
    for label, t0, t1 in windows:
        lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
        got = samples[lo:hi]
        entry = per.setdefault(label, {"samples": [], "joules": [], "mj": 0.0, "s": 0.0})
        entry["samples"].extend(got)
        counted = [s for s in got if s[2] is not None]
        if len(counted) >= 2 and counted[-1][0] > counted[0][0]:
            mj, span = counted[-1][2] - counted[0][2], counted[-1][0] - counted[0][0]
            entry["mj"] += mj
            entry["s"] += span
            entry["joules"].append(mj / 1e3 * (t1 - t0) / span)
    out = {}
    for label, e in per.items():
        got = e["samples"]
        mhz = [s[1] for s in got]
        temps = [s[3] for s in got if s[3] is not None]
        out[label] = {
            "samples": len(got),
            "sm_mhz": statistics.fmean(mhz) if mhz else None,
            "sm_mhz_min": min(mhz) if mhz else None,
            "power_w": e["mj"] / e["s"] / 1e3 if e["s"] > 0 else None,
            "energy_j": statistics.fmean(e["joules"]) if e["joules"] else None,
            "temp_c": statistics.fmean(temps) if temps else None,
        }
    out["_device"] = {"sm_mhz_max": max_mhz}
    return out


def _pci_bus_id(device):
    """NVML's bus id string for a torch CUDA device ("00000000:1B:00.0"), or None."""
    try:
        import torch

        p = torch.cuda.get_device_properties(device)
        return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
    except Exception:  # noqa: BLE001  (older torch without the fields)
        return None
