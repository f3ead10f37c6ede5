"""How long this machine takes to wake a thread that waits for another's signal: the part of a
synchronous call's host time that no code of a backend's removes.

A synchronous compressed call ends on gloo's thread (its last decode), which completes the
call's future; the calling thread, waiting on it, then has to be woken and scheduled before
the call returns. `lowbitcc perf`'s ``host`` column counts that wake-up (the wire's time ends
where the decode does). This probe times it alone, in C++ (a ``std::condition_variable``,
as torch's futures wait): one thread signals after ``--work-us`` of busy work (a decode's
stand-in), the other returns from its wait; the time from the signal to the return, per
round trip. ``--spin-us`` makes the waiter poll with ``sched_yield`` that long before it
blocks (how a backend could trade a core's time for the wake-up).

Built with the C++ compiler torch's extensions use (``torch.utils.cpp_extension``'s), no Python
in the timed loop. Feeds docs/host-time.md ("What is left, and the machine's part").

    python tests/probes/wake_latency.py [--rounds 2000] [--work-us 300] [--spin-us 0 1000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

SOURCE = r"""
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sched.h>
#include <thread>
#include <vector>
using clk = std::chrono::steady_clock;
int main(int argc, char** argv) {
  const int rounds = std::atoi(argv[1]), work_us = std::atoi(argv[2]), spin_us = std::atoi(argv[3]);
  std::mutex m;
  std::condition_variable cv;
  bool go = false;
  std::atomic<bool> done{false};
  clk::time_point signalled;
  std::vector<double> took;
  int blocked = 0;
  std::thread signaller([&] {
    for (int i = 0; i < rounds; ++i) {
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return go; });
        go = false;
      }
      const auto begun = clk::now();
      volatile double x = 0;
      while (clk::now() - begun < std::chrono::microseconds(work_us)) x += 1;
      {
        std::lock_guard<std::mutex> lock(m);
        signalled = clk::now();
        done = true;
      }
      cv.notify_all();
    }
  });
  for (int i = 0; i < rounds; ++i) {
    {
      std::lock_guard<std::mutex> lock(m);
      go = true;
    }
    cv.notify_all();
    const auto until = clk::now() + std::chrono::microseconds(spin_us);
    while (!done.load() && clk::now() < until) sched_yield();
    std::unique_lock<std::mutex> lock(m);
    if (!done.load()) ++blocked;
    cv.wait(lock, [&] { return done.load(); });
    took.push_back(std::chrono::duration<double, std::micro>(clk::now() - signalled).count());
    done = false;
  }
  signaller.join();
  std::sort(took.begin(), took.end());
  const size_t n = took.size();
  std::printf("%.1f %.1f %.1f %d\n", took[n / 10], took[n / 2], took[n * 9 / 10], blocked);
  return 0;
}
"""


def _build(directory: str) -> str:
    from torch.utils import cpp_extension

    source = os.path.join(directory, "wake.cpp")
    binary = os.path.join(directory, "wake")
    with open(source, "w") as f:
        f.write(SOURCE)
    compiler = cpp_extension.get_cxx_compiler()
    subprocess.run([compiler, "-O2", "-std=c++17", "-pthread", source, "-o", binary], check=True)
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--work-us", type=int, default=300, help="the signaller's busy time")
    parser.add_argument("--spin-us", type=int, nargs="+", default=[0, 1000],
                        help="how long the waiter polls before it blocks (one run each)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        binary = _build(directory)
        for spin in args.spin_us:
            out = subprocess.run([binary, str(args.rounds), str(args.work_us), str(spin)],
                                 check=True, capture_output=True, text=True).stdout.split()
            p10, p50, p90, blocked = float(out[0]), float(out[1]), float(out[2]), int(out[3])
            print(f"spin {spin} us: signal to return p10 {p10:.1f} us, median {p50:.1f} us, "
                  f"p90 {p90:.1f} us ({blocked} of {args.rounds} waits blocked)")


if __name__ == "__main__":
    main()
