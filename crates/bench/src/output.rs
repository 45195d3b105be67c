//! Writing to stdout and stderr without panicking when the reader has gone.
//!
//! Rust ignores SIGPIPE, so a write to a pipe whose reader has closed (`warren bench | head -1`)
//! fails with EPIPE, and `println!`/`eprintln!` panic on a failed write. Restoring SIGPIPE's default
//! action is no fix for a process that also holds sockets (mio writes them without MSG_NOSIGNAL: a
//! peer that closes would kill it). Here a reader that went away just stops the output; the command
//! carries on and exits with the code it would have.

use std::io::{self, Write};

/// `eprintln!` that does not panic when stderr is a closed pipe (there is nowhere left to report
/// the failed write, so it is dropped).
macro_rules! report {
    ($($arg:tt)*) => {
        $crate::output::stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes `text` to stdout. A closed pipe is not an error (nobody is left to read the text);
/// anything else (a full disk behind a redirection) is.
pub fn stdout(text: &str) -> io::Result<()> {
    let mut out = io::stdout().lock();
    ignore_closed_pipe(out.write_all(text.as_bytes()).and_then(|()| out.flush()))
}

/// Writes to stderr, dropping any failure; use `report!`.
pub fn stderr(args: std::fmt::Arguments<'_>) {
    let _ = io::stderr().lock().write_fmt(args);
}

fn ignore_closed_pipe(r: io::Result<()>) -> io::Result<()> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        r => r,
    }
}
