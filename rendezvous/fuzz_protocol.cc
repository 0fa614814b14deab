// libFuzzer target: the frame decoder and every message parser must return a Status, never
// crash, on any input. Built with -DLAUNCH_BUILD_FUZZERS=ON (scripts/fuzz_rendezvous).

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "rendezvous/protocol.h"

using namespace launch::rendezvous;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  // As a whole frame (header checks, length agreement, fields, typed validation).
  auto frame = DecodeFrame(bytes);
  if (frame.ok()) {
    (void)ValidateMessage(frame->type, frame->fields);
    // Round trip: what decodes must re-encode to the same frame.
    std::string again = EncodeFrame(frame->type, frame->fields);
    if (again != bytes) __builtin_trap();
  }
  // As a bare payload, parsed as every message type.
  auto fields = DecodeFields(bytes);
  if (fields.ok()) {
    for (uint16_t t = 1; t <= static_cast<uint16_t>(kLastMessageType); ++t)
      (void)ValidateMessage(static_cast<MessageType>(t), *fields);
    (void)FormatFailureReport(ParseFailureReport(*fields).ok() ? *ParseFailureReport(*fields)
                                                               : FailureReport{});
  }
  if (size >= kHeaderSize) (void)DecodeHeader(data);
  return 0;
}
