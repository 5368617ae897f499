//! What the kernel knows of an upstream socket, and the options that make
//! it give up a request's bytes only when the gateway means it to.
//!
//! `write()` returning means the gateway's kernel took the bytes, not that
//! the upstream has them: the send queue grows to megabytes while the
//! upstream does not read, and a socket closed normally (or by a process
//! that died) goes on delivering that queue, FIN last. For a fenced write
//! that would let an older request reach the upstream after its key opened
//! for a newer token. So every upstream socket:
//!
//! - **resets when closed** (`SO_LINGER {1, 0}`): the queue is dropped and
//!   the upstream gets RST, whoever closes it — this process, or the kernel
//!   after the process died. A connection is closed gracefully (FIN) only
//!   after an exchange that ended normally, when nothing is queued
//!   ([`close_gracefully`]);
//! - **has a small send buffer** ([`SEND_BUFFER`]): what a paused process's
//!   kernel can still deliver is bounded by it;
//! - **gives up on an upstream that acknowledges nothing**
//!   (`TCP_USER_TIMEOUT`, at most a fenced route's timeout: see
//!   [`limit_unacknowledged`]).
//!
//! And a request counts as *handed over* only once the upstream's TCP has
//! acknowledged all of it: the send queue is empty ([`unacknowledged`]).

use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

/// The send buffer asked for on every upstream socket (the kernel doubles
/// it for its bookkeeping). It bounds the bytes of a request that the
/// kernel of a paused or dead gateway could still deliver, and a body's
/// last bytes are written only once it has drained (see `flight`), so those
/// bytes are never a request's end. Large enough that a body streams at
/// loopback and LAN speed; over a long fat link it limits a single upload
/// (the send buffer bounds the bytes in flight).
pub(super) const SEND_BUFFER: usize = 16 * 1024;

/// Sets the options every upstream socket carries (see the module docs).
/// A failure is logged and the connection used anyway: only the linger
/// option is essential, and the kernel refuses it on no TCP socket.
pub(super) fn configure(tcp: &tokio::net::TcpStream) {
    let _ = tcp.set_nodelay(true);
    let sock = socket2::SockRef::from(tcp);
    if let Err(e) = sock.set_linger(Some(Duration::ZERO)) {
        tracing::error!("upstream socket: SO_LINGER {{1, 0}} refused: {e}");
    }
    if let Err(e) = sock.set_send_buffer_size(SEND_BUFFER) {
        tracing::warn!("upstream socket: SO_SNDBUF refused: {e}");
    }
}

/// Bytes written to `socket` that the peer's TCP has not acknowledged yet
/// (unsent and in flight). Zero: the upstream's kernel has everything.
/// Where it cannot be asked, answers as if something were outstanding, so
/// that nothing is taken as handed over that may not be.
pub(super) fn unacknowledged(socket: BorrowedFd<'_>) -> usize {
    #[cfg(target_os = "linux")]
    {
        let mut n: libc::c_int = 0;
        // SAFETY: `socket` is open while borrowed; SIOCOUTQ (TIOCOUTQ)
        // writes one int to `n`, which outlives the call.
        if unsafe { libc::ioctl(socket.as_raw_fd(), libc::TIOCOUTQ, &mut n) } == 0 {
            return usize::try_from(n).unwrap_or(usize::MAX);
        }
    }
    let _ = socket;
    usize::MAX
}

/// Whether a request's last bytes may be written now: nothing else is
/// queued (the upstream's TCP acknowledged all that was written) and the
/// upstream's window is open, so that the kernel sends them at once
/// rather than holding them for a process that may be paused by then.
pub(super) fn may_write_last(socket: BorrowedFd<'_>) -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: all-zero is a valid `tcp_info` (plain integers).
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: `socket` is open while borrowed; the kernel writes at most
        // `len` bytes into `info` and says how many in `len`.
        let got = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                (&mut info as *mut libc::tcp_info).cast(),
                &mut len,
            )
        };
        if got != 0 {
            return unacknowledged(socket) == 0;
        }
        let queued = info.tcpi_notsent_bytes != 0 || info.tcpi_unacked != 0;
        // A kernel older than the window's field (6.2) fills less.
        let has_window = len as usize
            >= std::mem::offset_of!(libc::tcp_info, tcpi_snd_wnd) + std::mem::size_of::<u32>();
        return !queued && (!has_window || info.tcpi_snd_wnd > 0);
    }
    #[allow(unreachable_code)]
    {
        unacknowledged(socket) == 0
    }
}

/// Bounds how long written bytes may stay unacknowledged before the kernel
/// gives the connection up (`TCP_USER_TIMEOUT`), rounded up to a whole
/// millisecond.
pub(super) fn limit_unacknowledged(socket: BorrowedFd<'_>, limit: Duration) {
    #[cfg(target_os = "linux")]
    {
        let ms = limit.as_millis().clamp(1, libc::c_uint::MAX as u128) as libc::c_uint;
        // SAFETY: `socket` is open while borrowed; the option's value is a
        // `c_uint` read from `ms`, which outlives the call.
        let r = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_USER_TIMEOUT,
                (&ms as *const libc::c_uint).cast(),
                std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
            )
        };
        if r != 0 {
            tracing::warn!(
                "upstream socket: TCP_USER_TIMEOUT refused: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    let _ = (socket, limit);
}

/// Lets a socket whose exchanges all ended normally close with a FIN rather
/// than a reset, when nothing of it is queued. Anything queued is dropped
/// by the reset instead, as on every other close.
pub(super) fn close_gracefully(socket: BorrowedFd<'_>) {
    if unacknowledged(socket) == 0 {
        let _ = socket2::SockRef::from(&socket).set_linger(None);
    }
}

/// Resets the TCP connection on `socket` without closing the descriptor:
/// both of the kernel's queues are dropped and RST is sent (on Linux,
/// `connect(2)` to `AF_UNSPEC`, which is how a TCP socket is dissolved in
/// place). Where that cannot be done, shuts it down both ways.
pub(super) fn reset(socket: BorrowedFd<'_>) {
    #[cfg(target_os = "linux")]
    {
        let unspec = libc::sockaddr {
            sa_family: libc::AF_UNSPEC as libc::sa_family_t,
            sa_data: [0; 14],
        };
        let len = std::mem::size_of::<libc::sockaddr>() as libc::socklen_t;
        // SAFETY: `socket` is an open descriptor for as long as it is
        // borrowed, and `unspec` outlives the call, which only reads it.
        if unsafe { libc::connect(socket.as_raw_fd(), &unspec, len) } == 0 {
            return;
        }
    }
    let _ = socket2::SockRef::from(&socket).shutdown(std::net::Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Bytes the peer does not read stay counted until it does; a
    /// socket closed with bytes still queued resets, and its peer never
    /// gets them. The peer's receive buffer is small, so that what it
    /// does not read stays queued on our side.
    #[tokio::test]
    async fn queued_bytes_are_counted_and_dropped_at_close() {
        let listener = tokio::net::TcpSocket::new_v4().expect("socket");
        listener.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        listener.bind("127.0.0.1:0".parse().unwrap()).expect("bind");
        let listener = listener.listen(1).expect("listen");
        let ours = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .expect("connect");
        let (mut theirs, _) = listener.accept().await.expect("accept");
        configure(&ours);
        assert_eq!(unacknowledged(ours.as_fd()), 0);
        assert!(may_write_last(ours.as_fd()));
        let piece = vec![b'x'; 16 * 1024];
        let mut written = 0usize;
        loop {
            match ours.try_write(&piece) {
                Ok(n) => written += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        assert!(unacknowledged(ours.as_fd()) > 0, "the peer reads nothing");
        assert!(!may_write_last(ours.as_fd()), "the peer reads nothing");
        drop(ours);
        let mut got = Vec::new();
        let read = theirs.read_to_end(&mut got).await;
        assert!(
            read.is_err() && got.len() < written,
            "a reset, not a FIN after {written} bytes: read {} then {read:?}",
            got.len()
        );
    }

    /// A socket with nothing queued closes gracefully when asked to.
    #[tokio::test]
    async fn an_empty_socket_closes_with_a_fin() {
        let (mut ours, mut theirs) = super::super::socket_pair().await;
        configure(&ours);
        ours.write_all(b"all of it").await.expect("write");
        let mut got = [0u8; 9];
        theirs.read_exact(&mut got).await.expect("read");
        tokio::time::timeout(Duration::from_secs(5), async {
            while unacknowledged(ours.as_fd()) != 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("acknowledged");
        close_gracefully(ours.as_fd());
        drop(ours);
        let mut rest = Vec::new();
        assert_eq!(theirs.read_to_end(&mut rest).await.expect("a FIN"), 0);
    }
}
