// ServedCounts: what the calls a group's steady runner served count in lowbitcc's statistics,
// kept in C++ and folded into them when they are read (lowbitcc/counters.py, `Stats.watch_counts`:
// `lowbitcc.stats()`, `Stats.sent`, `Stats.reset`), so that a served call touches no Python
// object of the statistics (their lock, their `Counters`; but the first call after
// `state.STATS` was replaced, which hands what it counted before to the statistics replaced).
//
// The fields are `Counters`' integer fields and its codec and wire seconds (lowbitcc/counters.py
// defines them; `kFieldNames` and `kSecondsNames` spell them as it does, `names` lists them and
// tests/backend/test_steady_runner.py checks that they are), by category ("exact",
// "compressed"). Integers add up to the same totals in any order, so the counts a served call
// leaves are the Python path's, bit for bit, once read; the seconds are measured, on either
// path. (The residual sums are not here: the encodes add them to their accumulator.)
//
// Threads: the counts are kept under their own mutex: the runner's calls and a read of the
// statistics (`take_counts`) hold the GIL too, a plan core's run on the issue lane (issue_lane.h)
// counts the bytes it sent without it.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace lowbitcc {

class __attribute__((visibility("hidden"))) ServedCounts {
 public:
  enum Category { kExact = 0, kCompressed = 1, kCategories };
  enum Field {
    kCalls,
    kTensorBytes,
    kLogicalBytes,
    kWireBytes,
    kIntraNodeBytes,
    kInterNodeBytes,
    kModelExact,
    kFields
  };
  static constexpr std::array<const char*, kCategories> kCategoryNames{"exact", "compressed"};
  static constexpr std::array<const char*, kFields> kFieldNames{
      "calls",          "tensor_bytes",     "logical_bytes", "wire_bytes",
      "intra_node_bytes", "inter_node_bytes", "model_exact"};
  enum Seconds { kCodec, kWire, kSeconds };
  static constexpr std::array<const char*, kSeconds> kSecondsNames{"codec_s", "wire_s"};

  // Every field's name, the counts' then the seconds'.
  static std::vector<std::string> names() {
    std::vector<std::string> all(kFieldNames.begin(), kFieldNames.end());
    all.insert(all.end(), kSecondsNames.begin(), kSecondsNames.end());
    return all;
  }

  void add(Category category, Field field, int64_t delta) {
    std::lock_guard<std::mutex> lock(mutex_);
    counts_[category][field] += delta;
  }
  void add_seconds(Category category, Seconds field, double seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    seconds_[category][field] += seconds;
  }

  // What was counted since the last take, by category and field (only those counted), and
  // zeroed: `{"exact": {"calls": 3, ...}, "compressed": {...}}`.
  py::dict take_counts() {
    std::lock_guard<std::mutex> lock(mutex_);
    py::dict taken;
    for (int c = 0; c < kCategories; ++c) {
      py::dict fields;
      for (int f = 0; f < kFields; ++f) {
        if (counts_[c][f] != 0) {
          fields[kFieldNames[f]] = py::int_(counts_[c][f]);
          counts_[c][f] = 0;
        }
      }
      for (int f = 0; f < kSeconds; ++f) {
        if (seconds_[c][f] != 0.0) {
          fields[kSecondsNames[f]] = py::float_(seconds_[c][f]);
          seconds_[c][f] = 0.0;
        }
      }
      if (!fields.empty()) {
        taken[kCategoryNames[c]] = fields;
      }
    }
    return taken;
  }

  // Whether anything was counted since the last take.
  bool pending() const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& fields : counts_) {
      for (int64_t count : fields) {
        if (count != 0) {
          return true;
        }
      }
    }
    for (const auto& fields : seconds_) {
      for (double seconds : fields) {
        if (seconds != 0.0) {
          return true;
        }
      }
    }
    return false;
  }

 private:
  mutable std::mutex mutex_;
  std::array<std::array<int64_t, kFields>, kCategories> counts_{};
  std::array<std::array<double, kSeconds>, kCategories> seconds_{};
};

}  // namespace lowbitcc
