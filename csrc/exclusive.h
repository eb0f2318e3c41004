// One caller at a time for an object with state that the bindings hand to Python (issues 38
// and 50). The bindings release the GIL while they compute, and even with the GIL held a
// conversion of an argument can run Python code (__array__, __index__) and so let another
// thread in: two calls interleaved on one object corrupted its state or the heap (an Engine in
// issue 38, the MTP head in issue 50). Every public method that reads or changes such an
// object's state holds an Exclusive::Use: a call from a second thread while one runs raises
// EngineBusy at once instead of blocking (a caller holding the GIL while it waited would stall
// the other thread) or racing. Nested calls on the holding thread pass through.
#pragma once
#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>

namespace sapwood {

// A second thread calling into an object while one call runs. Becomes a Python
// sapwood._core.EngineBusyError (a RuntimeError) whatever the object.
struct EngineBusy : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Exclusive {
 public:
  class Use {
   public:
    // `busy`: the whole message of the EngineBusy a second thread gets, naming the object.
    // `reentered`: if given, a nested call on the holding thread raises EngineBusy with it
    // instead of passing through: for an object whose calls convert Python arguments while
    // they hold its state (BackendOps), where an argument's __array__ calling back into it
    // would change that state under the outer call.
    Use(const Exclusive& x, const char* busy, const char* reentered = nullptr) : x_(x) {
      const std::thread::id me = std::this_thread::get_id();
      if (x.owner_.load(std::memory_order_acquire) == me) {  // nested on this thread
        if (reentered) throw EngineBusy(reentered);
        return;
      }
      std::thread::id none;
      if (!x.owner_.compare_exchange_strong(none, me, std::memory_order_acq_rel))
        throw EngineBusy(busy);
      outer_ = true;
    }
    ~Use() {
      if (outer_) x_.owner_.store(std::thread::id(), std::memory_order_release);
    }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    bool outer() const { return outer_; }  // this Use claimed the object (not a nested call)

   private:
    const Exclusive& x_;
    bool outer_ = false;
  };

 private:
  mutable std::atomic<std::thread::id> owner_{};
};

}  // namespace sapwood
