// Launch a kernel of the host build (prelude.h) as cuLaunchKernel would: `params[i]` points to
// the bytes of argument i; blocks run one after the other, each block's threads together.
#pragma once
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

template <typename... A, std::size_t... I>
void host_run(void (*kernel)(A...), unsigned gx, unsigned gy, unsigned threads, void** params,
              std::index_sequence<I...>) {
  const std::tuple<std::remove_cv_t<A>...> args{
      *static_cast<std::remove_cv_t<A>*>(params[I])...};
  gridDim = {gx, gy, 1};
  blockDim = {threads, 1, 1};
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned bx = 0; bx < gx; ++bx) {
      HostBlock block(threads);
      host_block = &block;
      std::vector<std::thread> running;
      for (unsigned t = 0; t < threads; ++t)
        running.emplace_back([&, t] {
          threadIdx = {t, 0, 0};
          blockIdx = {bx, by, 0};
          std::apply(kernel, args);
          block.warps[t / 32]->arrive_and_drop();
          block.block.arrive_and_drop();
        });
      for (auto& thread : running) thread.join();
      host_block = nullptr;
    }
}

template <typename... A>
void host_launch(void (*kernel)(A...), unsigned gx, unsigned gy, unsigned threads,
                 void** params) {
  host_run(kernel, gx, gy, threads, params, std::index_sequence_for<A...>{});
}
