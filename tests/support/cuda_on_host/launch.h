// Launch a kernel of the host build (prelude.h) as cuLaunchKernel would: `params[i]` points to
// the bytes of argument i (`sizes[i]` of them, checked); blocks run one after the other, last
// first, each block's threads together.
#pragma once
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

template <typename... A, std::size_t... I>
bool host_run(void (*kernel)(A...), unsigned gx, unsigned gy, unsigned threads, void** params,
              const unsigned long long* sizes, std::index_sequence<I...>) {
  if (((sizes[I] != sizeof(A)) || ...)) return false;  // an argument of another size
  const std::tuple<std::remove_cv_t<A>...> args{
      *static_cast<std::remove_cv_t<A>*>(params[I])...};
  gridDim = {gx, gy, 1};
  blockDim = {threads, 1, 1};
  for (unsigned by = gy; by-- > 0;)
    for (unsigned bx = gx; bx-- > 0;) {
      HostBlock block(threads);
      host_block = &block;
      std::vector<std::thread> running;
      for (unsigned t = 0; t < threads; ++t)
        running.emplace_back([&, t] {
          threadIdx = {t, 0, 0};
          blockIdx = {bx, by, 0};
          std::apply(kernel, args);
          __atomic_fetch_or(&block.exited[t / 32], 1u << (t % 32), __ATOMIC_SEQ_CST);
          block.warps[t / 32]->arrive_and_drop();
          block.block.arrive_and_drop();
        });
      for (auto& thread : running) thread.join();
      host_block = nullptr;
    }
  return true;
}

// false: an argument's size (`sizes`) is not the kernel's parameter's
template <typename... A>
bool host_launch(void (*kernel)(A...), unsigned gx, unsigned gy, unsigned threads,
                 void** params, const unsigned long long* sizes) {
  return host_run(kernel, gx, gy, threads, params, sizes, std::index_sequence_for<A...>{});
}
