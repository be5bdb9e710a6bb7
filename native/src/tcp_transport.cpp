// tcp transport (docs/PROTOCOL.md "The transport contract"): any IP network. One TCP socket per connection of the plan,
// connected and authenticated by Python (sparkccl/transport/tcp.py) and handed over as file
// descriptors; this file only moves frames.
//
// Frames (host byte order: every supported host is little-endian), a 24-byte header
// {u32 kind, u32 region, u64 a, u64 b} and then:
//   WRITE  region = destination region, a = offset, b = length; then b payload bytes
//   FLAG   a = flag word, b = value (also a call word's, Transport::put_call)
//   LINES  a = offset in the LL area, b = length; then b payload bytes (Transport::put_lines:
//          received whole, then stored a half at a time, store_lines)
//   ABORT  b = length of the text that follows (the sender's abort record)
//   BYE    nothing; the sender closes cleanly after it (no more frames)
//
// Sending: one thread per outgoing connection with a queue (like the shm copy workers),
// so the proxy never blocks on a socket. Frames go out in posting order, which gives the
// ordering contract: a flag frame is read by the receiver only after every earlier write
// frame on that socket has been placed.
// Receiving: one thread per incoming connection. A write is bounds-checked against the
// local registered region and received straight into it; a flag is stored with a release
// store after a full fence. Any socket error, EOF without BYE or bad frame sets the abort
// word with a text naming the connection. An ABORT frame sets the abort word with the
// peer's text, and on_abort() sends this rank's abort record to every peer, so a failure
// anywhere reaches every rank (also through relays in a ring).
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "control.h"
#include "transport.h"

namespace sparkccl {
namespace {

constexpr uint32_t KIND_WRITE = 0x57524954;  // "TIRW" in memory
constexpr uint32_t KIND_FLAG = 0x47414C46;
constexpr uint32_t KIND_ABORT = 0x54524241;
constexpr uint32_t KIND_BYE = 0x20455942;
constexpr uint32_t KIND_LINES = 0x454E494C;  // "LINE"
constexpr uint64_t MAX_ABORT_TEXT = 4096;
constexpr uint64_t FINISH_WAIT_NS = 5000000000ull;  // clean close: drain at most this long
constexpr uint64_t ABORT_FLUSH_NS = 1000000000ull;  // stop: let abort frames out first

struct Header {
  uint32_t kind, region;
  uint64_t a, b;
};
static_assert(sizeof(Header) == 24, "frame header is 24 bytes");

std::string errno_text(int e) {
  char buf[128];
  return std::string(strerror_r(e, buf, sizeof buf));
}

// Writes every byte of the iovecs; false with *err on a socket error.
bool send_all(int fd, struct iovec* iov, int n, int* err) {
  while (n > 0) {
    struct msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = size_t(n);
    ssize_t k = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return false;
    }
    size_t left = size_t(k);
    while (n > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --n;
    }
    if (n > 0) {
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return true;
}

// 1: all bytes read; 0: EOF before the first byte; -1: error or EOF in the middle (*err,
// 0 for EOF).
int recv_all(int fd, void* dst, uint64_t len, int* err) {
  uint8_t* p = static_cast<uint8_t*>(dst);
  uint64_t got = 0;
  while (got < len) {
    size_t want = size_t(std::min<uint64_t>(len - got, uint64_t(1) << 30));
    ssize_t k = recv(fd, p + got, want, MSG_WAITALL);
    if (k < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return -1;
    }
    if (k == 0) {
      *err = 0;
      return got == 0 ? 0 : -1;
    }
    got += uint64_t(k);
  }
  return 1;
}

struct SendOp {
  Header h;
  const uint8_t* src;  // write payload (local region), else nullptr
};

struct Sender : OrderedQueue<SendOp> {
  int fd = -1;
  bool stopping = false, finishing = false;
  std::string abort_text;   // set once by on_abort
  bool abort_pending = false;
  std::thread thread;
  std::atomic<bool> exited{false};
  std::atomic<bool> abort_requested{false}, abort_sent{false};
  std::atomic<bool> failed{false};
  std::string cause;  // written before `failed` is set

  void fail(const std::string& why) {
    cause = why;
    failed.store(true, std::memory_order_release);
  }

  void run() {
    std::vector<SendOp> batch;
    bool aborted = false;
    for (;;) {
      bool send_abort = false, bye = false;
      std::string text;
      {
        std::unique_lock<std::mutex> lk(mu);
        while (!stopping && !abort_pending && (queue.empty() || aborted) &&
               !(finishing && queue.empty())) {
          waiting = true;
          cv.wait(lk);
          waiting = false;
        }
        if (stopping) break;
        if (abort_pending) {
          abort_pending = false;
          send_abort = true;
          text.swap(abort_text);
          aborted = true;
          done.fetch_add(queue.size(), std::memory_order_release);  // dropped
          queue.clear();
        } else if (finishing && queue.empty()) {
          bye = true;
        } else {
          batch.swap(queue);
        }
      }
      int err = 0;
      if (send_abort) {
        // Best effort: the peer may be gone already.
        Header h{KIND_ABORT, 0, 0, text.size()};
        struct iovec iov[2] = {{&h, sizeof h}, {const_cast<char*>(text.data()), text.size()}};
        send_all(fd, iov, text.empty() ? 1 : 2, &err);
        abort_sent.store(true, std::memory_order_release);
        continue;
      }
      if (bye) {
        Header h{KIND_BYE, 0, 0, 0};
        struct iovec iov[1] = {{&h, sizeof h}};
        if (!aborted && send_all(fd, iov, 1, &err)) shutdown(fd, SHUT_WR);
        break;
      }
      for (size_t i = 0; i < batch.size(); ++i) {
        SendOp& op = batch[i];
        struct iovec iov[2] = {{&op.h, sizeof op.h},
                               {const_cast<uint8_t*>(op.src), op.src ? size_t(op.h.b) : 0}};
        if (!send_all(fd, iov, op.src && op.h.b ? 2 : 1, &err)) {
          fail(err == EPIPE || err == ECONNRESET
                   ? "send failed: " + errno_text(err) + " (the peer closed the connection)"
                   : "send failed: " + errno_text(err));
          done.fetch_add(batch.size() - i, std::memory_order_release);
          batch.clear();
          exited.store(true, std::memory_order_release);
          return;
        }
        done.fetch_add(1, std::memory_order_release);
      }
      batch.clear();
    }
    exited.store(true, std::memory_order_release);
  }
};

struct TcpRecvConn {
  int fd, peer, channel, root;
};

struct Receiver {
  TcpRecvConn info;
  std::thread thread;
};

class TcpTransport final : public Transport {
 public:
  TcpTransport(Registry* reg, uint64_t ctl, uint64_t flags, const std::vector<int>& send_fds,
               const std::vector<TcpRecvConn>& recv)
      : reg_(reg), ctl_(ctl), flags_(flags) {
    for (int fd : send_fds) {
      senders_.emplace_back(new Sender);
      senders_.back()->fd = fd;
    }
    for (const TcpRecvConn& r : recv) {
      receivers_.emplace_back(new Receiver);
      receivers_.back()->info = r;
    }
  }
  ~TcpTransport() override { stop(); }

  const char* name() const override { return "tcp"; }

  void start() override {
    std::lock_guard<std::mutex> lk(life_mu_);
    if (started_ || stopped_) return;
    started_ = true;
    for (auto& s : senders_) {
      Sender* sp = s.get();
      sp->thread = std::thread([sp] { sp->run(); });
    }
    for (auto& r : receivers_) {
      Receiver* rp = r.get();
      rp->thread = std::thread([this, rp] { receive(rp->info); });
    }
  }

  void finish() override {
    {
      std::lock_guard<std::mutex> lk(life_mu_);
      if (!started_ || stopped_) return;
    }
    for (auto& s : senders_) {
      {
        std::lock_guard<std::mutex> lk(s->mu);
        s->finishing = true;
      }
      s->cv.notify_all();
    }
    uint64_t t0 = now_ns();
    for (auto& s : senders_)
      while (!s->exited.load(std::memory_order_acquire) && now_ns() - t0 < FINISH_WAIT_NS)
        sleep_ns(200000);
  }

  void stop() override {
    std::lock_guard<std::mutex> lk(life_mu_);
    if (stopped_) return;
    stopped_ = true;
    // A failed communicator closing right away: its abort frames go out before the sockets
    // close, so that peers learn the cause rather than only see the connection drop.
    uint64_t t0 = now_ns();
    for (auto& s : senders_)
      while (started_ && s->abort_requested.load(std::memory_order_acquire) &&
             !s->abort_sent.load(std::memory_order_acquire) &&
             !s->exited.load(std::memory_order_acquire) && now_ns() - t0 < ABORT_FLUSH_NS)
        sleep_ns(200000);
    stopping_.store(true, std::memory_order_release);
    for (auto& s : senders_) {
      {
        std::lock_guard<std::mutex> g(s->mu);
        s->stopping = true;
      }
      s->cv.notify_all();
      if (s->fd >= 0) shutdown(s->fd, SHUT_RDWR);  // unblocks a send in progress
    }
    for (auto& r : receivers_)
      if (r->info.fd >= 0) shutdown(r->info.fd, SHUT_RDWR);  // unblocks recv
    for (auto& s : senders_)
      if (s->thread.joinable()) s->thread.join();
    for (auto& r : receivers_)
      if (r->thread.joinable()) r->thread.join();
    for (auto& s : senders_)
      if (s->fd >= 0) { close(s->fd); s->fd = -1; }
    for (auto& r : receivers_)
      if (r->info.fd >= 0) { close(r->info.fd); r->info.fd = -1; }
  }

  void on_abort(const std::string& text) override {
    for (auto& s : senders_) {
      {
        std::lock_guard<std::mutex> lk(s->mu);
        s->abort_text = text.substr(0, MAX_ABORT_TEXT);
        s->abort_pending = true;
      }
      s->abort_requested.store(true, std::memory_order_release);
      s->cv.notify_all();
    }
  }

  bool write(int conn, int src_region, uint64_t src_off, int dst_region, uint64_t dst_off,
             uint64_t len, std::string* cause) override {
    const uint64_t src_base = reg_->local_span(src_region, src_off, len, cause);
    if (!src_base) return false;
    // The destination is checked by the receiver (against its own registered region).
    SendOp op{Header{KIND_WRITE, uint32_t(dst_region), dst_off, len},
              reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(src_base + src_off))};
    senders_[size_t(conn)]->push(op);
    return true;
  }

  bool flag(int conn, uint64_t word, uint64_t value, std::string* cause) override {
    if (word >= reg_->num_flags) {
      *cause = "flag word " + std::to_string(word) + " out of range (" +
               std::to_string(reg_->num_flags) + " words)";
      return false;
    }
    senders_[size_t(conn)]->push(SendOp{Header{KIND_FLAG, 0, word, value}, nullptr});
    return true;
  }

  bool put_call(int conn, uint64_t word, const uint64_t* values, uint64_t n,
                std::string* cause) override {
    if (!call_entry_in_range(*reg_, word, n, cause)) return false;
    // As flag frames: the receiver stores any word of its flag section the same way.
    for (uint64_t k = 0; k < n; ++k)
      senders_[size_t(conn)]->push(SendOp{Header{KIND_FLAG, 0, word + k, values[k]}, nullptr});
    return true;
  }

  bool put_lines(int conn, uint64_t off, uint64_t len, std::string* cause) override {
    if (!lines_in_range(*reg_, off, len, cause)) return false;
    senders_[size_t(conn)]->push(SendOp{
        Header{KIND_LINES, 0, off, len},
        reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(flags_ + reg_->ll_off + off))});
    return true;
  }

  bool poll(int* conn, std::string* cause) override {
    for (size_t i = 0; i < senders_.size(); ++i) {
      if (senders_[i]->failed.load(std::memory_order_acquire)) {
        *conn = int(i);
        *cause = senders_[i]->cause;
        return false;
      }
    }
    return true;
  }

  uint64_t outstanding() const override { return outstanding_in(senders_); }

 private:
  void receive(const TcpRecvConn& c) {
    const int fd = c.fd;
    bool bye = false;
    auto who = [&] {
      return "rank " + std::to_string(reg_->rank) + ": tcp transport: incoming connection from "
             "peer " + std::to_string(c.peer) + " (our channel " + std::to_string(c.channel) +
             ", root " + std::to_string(c.root) + "): ";
    };
    auto fail = [&](const std::string& why) {
      if (stopping_.load(std::memory_order_acquire)) return;
      set_abort(ctl_, layout::ABORT_TRANSPORT, who() + why);
    };
    std::string text;
    std::vector<uint8_t> lines;  // LINES frames' payload, before store_lines
    for (;;) {
      Header h;
      int err = 0;
      int r = recv_all(fd, &h, sizeof h, &err);
      if (r == 0) {
        if (!bye && abort_code(ctl_) == layout::ABORT_NONE)
          fail("connection closed by the peer without a goodbye (the peer exited, crashed, or "
               "dropped its communicator without close())");
        return;
      }
      if (r < 0) {
        if (err == 0)
          fail("connection closed by the peer in the middle of a frame header");
        else if (!bye && abort_code(ctl_) == layout::ABORT_NONE)
          fail("receive failed: " + errno_text(err));
        return;
      }
      if (bye) {
        fail("frame received after the peer's goodbye");
        return;
      }
      switch (h.kind) {
        case KIND_WRITE: {
          if (h.region >= uint32_t(layout::NUM_REGIONS)) {
            fail("write to region " + std::to_string(h.region) + ", which does not exist");
            return;
          }
          int reg = int(h.region);
          uint64_t base = reg_->base[reg].load(std::memory_order_acquire);
          if (!base) {
            fail(std::string("write to region ") + region_name(reg) +
                 ", which is not registered here");
            return;
          }
          uint64_t size = reg_->local_size(reg);
          if (h.a > size || h.b > size - h.a) {
            fail("write to [" + std::to_string(h.a) + ", " + std::to_string(h.a + h.b) +
                 ") past the end of region " + region_name(reg) + " (" + std::to_string(size) +
                 " bytes)");
            return;
          }
          if (h.b) {
            r = recv_all(fd, reinterpret_cast<void*>(static_cast<uintptr_t>(base + h.a)), h.b,
                         &err);
            if (r != 1) {
              fail(err ? "receive failed in the middle of a write: " + errno_text(err)
                       : "connection closed by the peer in the middle of a write");
              return;
            }
          }
          break;
        }
        case KIND_LINES: {
          std::string why;
          if (!lines_in_range(*reg_, h.a, h.b, &why)) {
            fail(why);
            return;
          }
          // (received whole first: recv() may fill the buffer in any order and width)
          lines.resize(size_t(h.b));
          if (h.b && recv_all(fd, lines.data(), h.b, &err) != 1) {
            fail(err ? "receive failed in the middle of LL lines: " + errno_text(err)
                     : "connection closed by the peer in the middle of LL lines");
            return;
          }
          store_lines(reinterpret_cast<uint8_t*>(
                          static_cast<uintptr_t>(flags_ + reg_->ll_off + h.a)),
                      lines.data(), h.b);
          break;
        }
        case KIND_FLAG: {
          if (h.a >= reg_->num_words) {  // a flag word or a call word
            fail("flag word " + std::to_string(h.a) + " out of range (" +
                 std::to_string(reg_->num_words) + " words)");
            return;
          }
          std::atomic_thread_fence(std::memory_order_seq_cst);
          store_release(word_at(flags_, h.a * layout::FLAG_BYTES), h.b);
          break;
        }
        case KIND_ABORT: {
          if (h.b > MAX_ABORT_TEXT) {
            fail("abort frame with a " + std::to_string(h.b) + "-byte text");
            return;
          }
          text.assign(size_t(h.b), '\0');
          if (h.b && recv_all(fd, &text[0], h.b, &err) != 1) text = "(text lost)";
          set_abort(ctl_, layout::ABORT_PEER,
                    "rank " + std::to_string(reg_->rank) + ": peer " + std::to_string(c.peer) +
                        " aborted: " + text);
          break;  // keep reading until EOF (quietly: the communicator has failed)
        }
        case KIND_BYE:
          bye = true;
          break;
        default: {
          char buf[64];
          std::snprintf(buf, sizeof buf, "bad frame header (kind 0x%08x)", h.kind);
          fail(buf);
          return;
        }
      }
    }
  }

  Registry* reg_;
  const uint64_t ctl_, flags_;
  std::vector<std::unique_ptr<Sender>> senders_;
  std::vector<std::unique_ptr<Receiver>> receivers_;
  std::mutex life_mu_;
  bool started_ = false, stopped_ = false;
  std::atomic<bool> stopping_{false};
};

}  // namespace

TcpFactory::TcpFactory(std::vector<int> send_fds, const std::vector<std::vector<int64_t>>& recv)
    : send_fds_(std::move(send_fds)), recv_(recv) {
  std::string bad;
  for (int fd : send_fds_)
    if (fd < 0) bad = "negative send fd";
  for (auto& r : recv_)
    if (r.size() != 4 || r[0] < 0) bad = "incoming rows are [fd >= 0, peer, channel, root]";
  if (!bad.empty()) {
    close_all();
    throw std::invalid_argument("TcpTransport: " + bad);
  }
}

TcpFactory::~TcpFactory() { close_all(); }

void TcpFactory::close_all() {
  for (int fd : send_fds_)
    if (fd >= 0) ::close(fd);
  for (auto& r : recv_)
    if (!r.empty() && r[0] >= 0) ::close(int(r[0]));
  send_fds_.clear();
  recv_.clear();
}

std::unique_ptr<Transport> TcpFactory::make(const ProxySide& side) {
  const Registry& reg = *side.reg;
  std::string bad;
  std::vector<TcpRecvConn> in;
  if (send_fds_.size() != side.conns.size())
    bad = std::to_string(send_fds_.size()) + " send fds for " +
          std::to_string(side.conns.size()) + " connections";
  for (auto& r : recv_) {
    if (!bad.empty()) break;
    if (r[1] < 0 || r[1] >= reg.world || r[1] == reg.rank || r[2] < 0 ||
        r[2] >= layout::CHANNELS || r[3] < 0 || r[3] >= layout::MAX_ROOTS)
      bad = "incoming rows are [fd, peer, channel, root] with peer, channel, root in range";
    else
      in.push_back(TcpRecvConn{int(r[0]), int(r[1]), int(r[2]), int(r[3])});
  }
  if (!bad.empty()) {
    close_all();  // refused: nobody else will close them
    throw std::invalid_argument("TcpTransport: " + bad);
  }
  std::unique_ptr<Transport> t(new TcpTransport(side.reg, side.ctl, side.flags, send_fds_, in));
  send_fds_.clear();  // the transport owns them now
  recv_.clear();
  return t;
}

}  // namespace sparkccl
