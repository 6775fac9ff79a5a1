// dsv4_noop and the testing modules' registrations (declared in testing.h):
// no platform code, so one definition serves both testing modules.
#include "testing/testing.h"

namespace dsv4 {
namespace {
namespace ffi = xla::ffi;
ffi::Error NoopImpl(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }
}  // namespace

// Command-buffer compatible like the op handlers, so that on a GPU it is
// timed under the same capture as they are.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Noop, NoopImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

nanobind::dict TestingTargets() {
  nanobind::dict targets;
  targets["dsv4_noop"] = nanobind::capsule(reinterpret_cast<void*>(Noop));
  return targets;
}

}  // namespace dsv4
