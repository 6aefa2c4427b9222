// A typed handle on one of the registered ops, for the calls a fused op makes through the dispatcher
// (decode_attention.cpp, decode_layers.cpp): Fn is the op's C++ signature as its kernel declares it.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace trtprompt_ops {

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

}  // namespace trtprompt_ops
