// The helper threads that share each product, and the calls that hand them work.
#include "few_rows.h"

namespace {

// Work split into parts that the calling thread and the helper threads claim one at a time (a
// product's columns, a layer's attention heads). A caller never waits for a part nobody has claimed,
// so concurrent calls cannot starve each other.
struct Job {
  std::function<void(int64_t)> part;  // runs part p; what it refers to outlives the job's last part
  int64_t parts;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunParts() {
    for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      part(p);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Set by S3dFewRowConfigure before the first product (kernel/ffi.py does, when it loads the library).
std::atomic<int64_t> configured_threads{1};
std::atomic<int64_t> configured_spin_us{0};

// Helper threads wait for the next product on a futex. After a product they first spin for
// `spin_us`: the products of one decode pass come a few microseconds apart, and waking a sleeping
// thread for each would cost more than its share of the work. Between passes, and after the decode,
// they sleep, so that they take no core from the rest of the pass.
class Helpers {
 public:
  static Helpers& Get() {
    static Helpers* helpers = new Helpers();  // never destroyed: its threads live as long as the process
    return *helpers;
  }
  int64_t size() const { return size_; }

  void Post(std::shared_ptr<Job> job) {
    std::atomic_store_explicit(&job_, std::move(job), std::memory_order_release);
    posted_.fetch_add(1, std::memory_order_release);
    posted_.notify_all();
  }

 private:
  Helpers() : size_(configured_threads.load() - 1), spin_(std::chrono::microseconds(configured_spin_us.load())) {
    for (int64_t i = 0; i < size_; ++i) std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    uint64_t seen = posted_.load(std::memory_order_acquire);
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      uint64_t now;
      while ((now = posted_.load(std::memory_order_acquire)) == seen) {
        if (std::chrono::steady_clock::now() - start < spin_) {
#if defined(__x86_64__) || defined(__i386__)
          __builtin_ia32_pause();
#endif
        } else {
          posted_.wait(seen, std::memory_order_acquire);
        }
      }
      seen = now;
      if (auto job = std::atomic_load_explicit(&job_, std::memory_order_acquire)) job->RunParts();
    }
  }

  const int64_t size_;
  const std::chrono::microseconds spin_;
  std::atomic<uint64_t> posted_{0};
  std::shared_ptr<Job> job_;
};

}  // namespace

namespace s3d {

void Share(int64_t parts, std::function<void(int64_t)> part) {
  auto job = std::make_shared<Job>();
  job->part = std::move(part);
  job->parts = parts;
  if (parts > 1) Helpers::Get().Post(job);
  job->RunParts();
  while (job->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

void Run(const std::vector<Product>& products) {
  int64_t parts = 0;
  for (const Product& product : products) parts += product.parts;
  Share(parts, [&](int64_t part) {
    size_t i = 0;
    for (; part >= products[i].parts; ++i) part -= products[i].parts;
    const Product& product = products[i];
    const int64_t n0 = part * product.part_columns;
    product.columns(n0, std::min(product.N, n0 + product.part_columns));
  });
}

int64_t Threads() { return Helpers::Get().size() + 1; }

}  // namespace s3d

// The threads sharing each product (the caller included) and the helpers' spin after a product, in
// microseconds. Only the first call before any product takes effect: the helpers start with it.
extern "C" void S3dFewRowConfigure(int64_t threads, int64_t spin_us) {
  configured_threads.store(std::max<int64_t>(1, threads));
  configured_spin_us.store(std::max<int64_t>(0, spin_us));
}
