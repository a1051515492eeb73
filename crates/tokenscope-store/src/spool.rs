//! The on-disk spool: a crash-safe, byte-payload FIFO that holds batches while the store is
//! slow, failing or down, and gives them back oldest-first when it recovers (also after a
//! crash, on the next start).
//!
//! ```text
//!  append(payload) ──▶ [ 00000000000000000001.seg ][ 00000000000000000042.seg ] … ◀── write end
//!                        ▲ read end: peek() → ack(seq)            ack ──▶ "ack" file (atomic)
//! ```
//!
//! # On-disk format
//!
//! A spool is a directory holding:
//! * `lock` — an empty file, exclusively locked (`flock` on Unix, via [`File::try_lock`]) for
//!   as long as a [`Spool`] is open on the directory. A second open — from another process or
//!   from the same one — fails with [`SpoolError::Locked`].
//! * Segment files `NNNNNNNNNNNNNNNNNNNN.seg` (20 decimal digits, zero-padded): append-only
//!   sequences of frames. The number orders the segments (it is the sequence number the spool
//!   was about to assign when the segment was created; it is only used for ordering).
//!   A new segment is started when the current one is non-empty and the next frame would
//!   take it past [`SpoolConfig::segment_bytes`] (so a frame larger than that sits alone in
//!   its segment).
//! * `probe.tmp` — written, synced and removed by [`Spool::open`] to prove the directory
//!   takes new files; a spool that cannot (read-only mount, immutable directory,
//!   permissions) fails to open instead of failing at its first append.
//! * `ack` — the sequence number of the last acknowledged entry, 16 bytes:
//!   `b"TSA\x01"`, `seq: u64 LE`, `crc32(first 12 bytes): u32 LE`. It is replaced atomically
//!   (write `ack.tmp`, `sync_data`, rename over `ack`, sync the directory). No `ack` file means
//!   nothing was ever acknowledged; an unreadable one is ignored with a warning (everything
//!   is replayed: at-least-once).
//!
//! Each frame is a 28-byte header followed by the payload ([`FRAME_HEADER_BYTES`]):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 3 | magic `b"TSP"` |
//! | 3 | 1 | format version, `1` |
//! | 4 | 4 | payload length `len`, `u32` LE |
//! | 8 | 4 | CRC-32 (IEEE, `crc32fast`) of bytes 0..8, bytes 12..28 and the payload, `u32` LE |
//! | 12 | 8 | sequence number `seq`, `u64` LE |
//! | 20 | 8 | `appended_at_ms`, unix milliseconds, `u64` LE |
//! | 28 | `len` | payload |
//!
//! # Invariants
//!
//! * **Order.** Entries come back ([`Spool::peek`]) in append order. Sequence numbers start
//!   at 1 and strictly increase in append order, across restarts too; the only number ever
//!   handed out twice is that of an entry that did not survive a crash (a torn tail, see
//!   below), which by then no longer exists.
//! * **At-least-once.** [`Spool::ack`] persists the acknowledgement (atomically) before it
//!   returns; an entry whose `ack` returned `Ok` is never given back again, even after a
//!   crash. An entry that was not acknowledged is given back again after a restart (it may
//!   have been written to the store already: consumers must be idempotent).
//! * **Durability.** With [`SpoolConfig::fsync`], `append` returns after `sync_data` of the
//!   segment (and of the directory when it created a segment) and `ack` after the file and
//!   directory syncs above; without it both survive a process crash (`SIGKILL`: the data is
//!   in the kernel) but not necessarily a power loss.
//! * **Cap.** [`Spool::bytes`] (the frames of unacknowledged entries, headers included) never
//!   exceeds [`SpoolConfig::max_bytes`]: an `append` that would exceed it returns
//!   [`Append::Full`] and writes nothing; the caller counts what it could not spool as lost.
//!   On disk the spool additionally holds the already acknowledged frames of the oldest
//!   segment (segments are deleted whole), so its segment files take at most
//!   `max_bytes + max(segment_bytes, largest frame)` bytes (a segment only exceeds
//!   `segment_bytes` when it holds a single larger frame).
//! * **Bounded memory.** Nothing reads the whole spool into memory: `peek` reads one frame,
//!   recovery streams each segment through the checksum with a fixed buffer. The spool keeps
//!   one entry per segment file, not per frame.
//! * **Files.** One append handle (on the newest segment) and one read handle (on the oldest)
//!   are kept open. A segment is deleted once all its entries are acknowledged and it is no
//!   longer the one being appended to.
//!
//! # Recovery ([`Spool::open`])
//!
//! Every segment is read once and every frame checked (magic, version, length within the
//! file, checksum, `seq` strictly greater than the previous frame's):
//! * **Torn tail.** In the newest segment, an invalid frame that reaches the end of the file
//!   (a partial header, a length that runs past the end, or a checksum mismatch on a frame
//!   that ends exactly at the end of the file) is what an interrupted append leaves: the file
//!   is truncated before it. Its bytes are counted in [`Spool::torn_bytes`]; if it was an
//!   unacknowledged entry, that entry is lost (it was never acknowledged as written by
//!   `append`'s caller either, since `append` had not returned).
//! * **Corruption.** Any other invalid frame makes the rest of its segment unreadable: it is
//!   skipped (in the newest segment: truncated away, so appends can continue), a
//!   `tracing::warn!` names the file, offset and reason, and the skipped bytes are added to
//!   [`Spool::corrupt_skipped`] (a count of **bytes**, from the start of the invalid frame to
//!   the end of its segment; the number of entries in them is unknowable) and the event to
//!   [`Spool::corrupt_regions`]. The same applies if a frame is found damaged later, when
//!   `peek` reads it (its checksum is checked again). Recovery never panics and never loops:
//!   each frame is visited once, and each corruption ends its segment.
//! * Segments whose entries are all acknowledged are deleted, except the newest one.
//! * The next sequence number is one past the largest of: the last valid frame's `seq` and
//!   the acknowledged `seq`.
//!
//! Opening reads the whole spool once (to validate it and count [`Spool::len`] and
//! [`Spool::bytes`] exactly); for a full 1 GiB spool that is one sequential read of 1 GiB.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Size of a frame header in bytes; a frame takes `FRAME_HEADER_BYTES + payload.len()` bytes.
pub const FRAME_HEADER_BYTES: u64 = HEADER as u64;
/// The largest payload a frame can hold (its length is a `u32`).
pub const MAX_PAYLOAD_BYTES: u64 = u32::MAX as u64;

const HEADER: usize = 28;
const MAGIC: [u8; 3] = *b"TSP";
const VERSION: u8 = 1;
const SEGMENT_EXT: &str = ".seg";
const SEGMENT_DIGITS: usize = 20;
const LOCK_FILE: &str = "lock";
const ACK_FILE: &str = "ack";
const ACK_TMP_FILE: &str = "ack.tmp";
const ACK_MAGIC: [u8; 4] = *b"TSA\x01";
const ACK_BYTES: usize = 16;
/// Payloads up to this size are copied behind their header and written with one `write`;
/// larger ones are written in place (header, then payload) to avoid the copy.
const COALESCE_BYTES: usize = 64 * 1024;
/// Read buffer of the recovery scan.
const SCAN_BUFFER_BYTES: usize = 256 * 1024;

/// Where and how the spool keeps its files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolConfig {
    /// The spool directory; created (with its parents) if missing.
    pub dir: PathBuf,
    /// Cap on the bytes of unacknowledged frames (headers included); an append beyond it
    /// returns [`Append::Full`]. Default 1 GiB.
    pub max_bytes: u64,
    /// A new segment file is started when the next frame would take the current one past
    /// this size. Default 64 MiB.
    pub segment_bytes: u64,
    /// `sync_data` after each append and each ack (and sync the directory when files are
    /// created or renamed). Default `true`.
    pub fsync: bool,
}

impl Default for SpoolConfig {
    fn default() -> Self {
        SpoolConfig {
            dir: PathBuf::from("./tokenscope-spool"),
            max_bytes: 1024 * 1024 * 1024,
            segment_bytes: 64 * 1024 * 1024,
            fsync: true,
        }
    }
}

impl SpoolConfig {
    /// The defaults, in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        SpoolConfig {
            dir: dir.into(),
            ..SpoolConfig::default()
        }
    }
}

/// What can go wrong with the spool.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    /// A file system operation failed.
    #[error("spool: {op} {}: {source}", path.display())]
    Io {
        /// What was being done ("append to", "open", "sync", …).
        op: &'static str,
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Another [`Spool`] (in this process or another one) has the directory open.
    #[error("spool directory {} is in use by another spool (lock file {})", dir.display(), dir.join(LOCK_FILE).display())]
    Locked {
        /// The spool directory.
        dir: PathBuf,
    },
    /// The payload is larger than a frame can hold ([`MAX_PAYLOAD_BYTES`]).
    #[error("spool: payload of {len} bytes exceeds the frame limit of {MAX_PAYLOAD_BYTES} bytes")]
    PayloadTooLarge {
        /// The payload's length.
        len: usize,
    },
    /// [`Spool::ack`] was called with a sequence number that is not the oldest
    /// unacknowledged entry's (or the spool is empty).
    #[error("spool: ack of seq {got}, but the oldest unacknowledged entry is {}", match oldest { Some(s) => format!("seq {s}"), None => "none (empty)".to_owned() })]
    AckOutOfOrder {
        /// The sequence number passed to `ack`.
        got: u64,
        /// The oldest unacknowledged entry's sequence number, if any.
        oldest: Option<u64>,
    },
}

/// Name of the file [`Spool::open`] writes, syncs and removes to prove the directory takes
/// new files (segments are only created at the first append, long after start-up).
const PROBE_FILE: &str = "probe.tmp";

/// Creates, writes, syncs and removes [`PROBE_FILE`] in `dir`: a spool that cannot take new
/// files (read-only mount, immutable directory, permissions) fails here, at start-up, instead
/// of at its first append.
fn probe_write(dir: &Path) -> Result<(), SpoolError> {
    let path = dir.join(PROBE_FILE);
    let res = (|| -> io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)?;
        f.write_all(b"tokenscope spool write probe")?;
        f.sync_data()?;
        drop(f);
        fs::remove_file(&path)
    })();
    res.map_err(io_err("write probe file", &path))
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> SpoolError + 'a {
    move |source| SpoolError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// One spooled entry, as returned by [`Spool::peek`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolEntry {
    /// Its sequence number (pass it to [`Spool::ack`]).
    pub seq: u64,
    /// When it was appended, unix milliseconds.
    pub appended_at_ms: u64,
    /// The bytes given to [`Spool::append`].
    pub payload: Vec<u8>,
}

/// The outcome of [`Spool::append`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Append {
    /// Written (and synced, with [`SpoolConfig::fsync`]) under this sequence number.
    Appended {
        /// The entry's sequence number.
        seq: u64,
    },
    /// The frame would take the unacknowledged bytes past [`SpoolConfig::max_bytes`];
    /// nothing was written.
    Full,
}

/// A frame header (see the module docs for the layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FrameHeader {
    len: u32,
    crc: u32,
    seq: u64,
    appended_at_ms: u64,
}

impl FrameHeader {
    fn frame_bytes(&self) -> u64 {
        FRAME_HEADER_BYTES + u64::from(self.len)
    }

    /// The header for `payload`, its checksum computed.
    fn new(seq: u64, appended_at_ms: u64, len: u32, payload: &[u8]) -> FrameHeader {
        let mut h = FrameHeader {
            len,
            crc: 0,
            seq,
            appended_at_ms,
        };
        let mut hasher = header_hasher(&h.encode());
        hasher.update(payload);
        h.crc = hasher.finalize();
        h
    }

    fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0..3].copy_from_slice(&MAGIC);
        b[3] = VERSION;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..12].copy_from_slice(&self.crc.to_le_bytes());
        b[12..20].copy_from_slice(&self.seq.to_le_bytes());
        b[20..28].copy_from_slice(&self.appended_at_ms.to_le_bytes());
        b
    }

    /// Parses a header; the checksum is not verified here (it needs the payload).
    fn decode(b: &[u8; HEADER]) -> Result<FrameHeader, String> {
        if b[0..3] != MAGIC {
            return Err("bad frame magic".to_owned());
        }
        if b[3] != VERSION {
            return Err(format!("unknown frame version {}", b[3]));
        }
        Ok(FrameHeader {
            len: le_u32(&b[4..8]),
            crc: le_u32(&b[8..12]),
            seq: le_u64(&b[12..20]),
            appended_at_ms: le_u64(&b[20..28]),
        })
    }
}

/// A hasher fed with the checksummed header bytes (all but the checksum field).
fn header_hasher(b: &[u8; HEADER]) -> crc32fast::Hasher {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&b[0..8]);
    hasher.update(&b[12..HEADER]);
    hasher
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn segment_name(id: u64) -> String {
    format!("{id:0width$}{SEGMENT_EXT}", width = SEGMENT_DIGITS)
}

fn parse_segment_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(SEGMENT_EXT)?;
    if digits.len() != SEGMENT_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// One segment file, as the spool tracks it.
#[derive(Debug)]
struct Segment {
    id: u64,
    path: PathBuf,
    /// End of its valid frames: appends go here, reading stops here.
    size: u64,
    /// Unacknowledged entries in it.
    entries: u64,
    /// Bytes of those entries' frames.
    unacked_bytes: u64,
    /// No more appends go here (a write failed, or corruption was found in it while it was
    /// the newest segment); the next append starts a new segment.
    sealed: bool,
}

/// The result of reading one frame.
enum FrameRead {
    Valid {
        header: FrameHeader,
        payload: Option<Vec<u8>>,
    },
    Corrupt(String),
}

/// Reads the frame at `off` of `file`, which is valid up to `limit`; with `with_payload`
/// the payload is read and the checksum verified.
fn read_frame_at(
    file: &mut File,
    off: u64,
    limit: u64,
    with_payload: bool,
) -> io::Result<FrameRead> {
    if limit.saturating_sub(off) < FRAME_HEADER_BYTES {
        return Ok(FrameRead::Corrupt("partial frame header".to_owned()));
    }
    file.seek(SeekFrom::Start(off))?;
    let mut hb = [0u8; HEADER];
    match file.read_exact(&mut hb) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Ok(FrameRead::Corrupt(
                "file ends inside a frame header".to_owned(),
            ))
        }
        Err(e) => return Err(e),
    }
    let header = match FrameHeader::decode(&hb) {
        Ok(h) => h,
        Err(reason) => return Ok(FrameRead::Corrupt(reason)),
    };
    if off + header.frame_bytes() > limit {
        return Ok(FrameRead::Corrupt(
            "frame length runs past the segment's end".to_owned(),
        ));
    }
    if !with_payload {
        return Ok(FrameRead::Valid {
            header,
            payload: None,
        });
    }
    let mut payload = vec![0u8; header.len as usize];
    match file.read_exact(&mut payload) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Ok(FrameRead::Corrupt("file ends inside a frame".to_owned()))
        }
        Err(e) => return Err(e),
    }
    let mut hasher = header_hasher(&hb);
    hasher.update(&payload);
    if hasher.finalize() != header.crc {
        return Ok(FrameRead::Corrupt("checksum mismatch".to_owned()));
    }
    Ok(FrameRead::Valid {
        header,
        payload: Some(payload),
    })
}

/// Why a segment scan stopped before the end of the file.
#[derive(Debug)]
enum ScanStop {
    /// The invalid frame reaches the end of the file (an interrupted append).
    Torn(String),
    /// Anything else.
    Corrupt(String),
}

/// What a recovery scan found in one segment.
#[derive(Debug)]
struct Scan {
    file_len: u64,
    valid_end: u64,
    last_seq: Option<u64>,
    entries: u64,
    unacked_bytes: u64,
    first_unacked_off: Option<u64>,
    stop: Option<ScanStop>,
}

/// Validates every frame of one segment; `prev_seq` is the last valid frame's seq before it.
fn scan_segment(path: &Path, mut prev_seq: Option<u64>, acked: u64) -> Result<Scan, SpoolError> {
    let file = File::open(path).map_err(io_err("open", path))?;
    let file_len = file.metadata().map_err(io_err("stat", path))?.len();
    let mut reader = BufReader::with_capacity(SCAN_BUFFER_BYTES, file);
    let mut scan = Scan {
        file_len,
        valid_end: 0,
        last_seq: None,
        entries: 0,
        unacked_bytes: 0,
        first_unacked_off: None,
        stop: None,
    };
    let mut off = 0u64;
    while off < file_len {
        let remaining = file_len - off;
        if remaining < FRAME_HEADER_BYTES {
            scan.stop = Some(ScanStop::Torn(format!(
                "partial frame header ({remaining} bytes)"
            )));
            break;
        }
        let mut hb = [0u8; HEADER];
        reader.read_exact(&mut hb).map_err(io_err("read", path))?;
        let header = match FrameHeader::decode(&hb) {
            Ok(h) => h,
            Err(reason) => {
                scan.stop = Some(ScanStop::Corrupt(reason));
                break;
            }
        };
        let frame = header.frame_bytes();
        if frame > remaining {
            scan.stop = Some(ScanStop::Torn(format!(
                "frame of {frame} bytes runs past the end of the file ({remaining} bytes left)"
            )));
            break;
        }
        let mut hasher = header_hasher(&hb);
        let mut left = u64::from(header.len);
        while left > 0 {
            let buf = reader.fill_buf().map_err(io_err("read", path))?;
            if buf.is_empty() {
                return Err(SpoolError::Io {
                    op: "read",
                    path: path.to_path_buf(),
                    source: io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "segment shrank while it was being read",
                    ),
                });
            }
            let n = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            hasher.update(&buf[..n]);
            reader.consume(n);
            left -= n as u64;
        }
        if hasher.finalize() != header.crc {
            scan.stop = Some(if frame == remaining {
                ScanStop::Torn("checksum mismatch in the last frame".to_owned())
            } else {
                ScanStop::Corrupt("checksum mismatch".to_owned())
            });
            break;
        }
        if prev_seq.is_some_and(|p| header.seq <= p) {
            scan.stop = Some(ScanStop::Corrupt(format!(
                "sequence number {} does not follow {}",
                header.seq,
                prev_seq.unwrap_or(0)
            )));
            break;
        }
        prev_seq = Some(header.seq);
        scan.last_seq = Some(header.seq);
        if header.seq > acked {
            scan.entries += 1;
            scan.unacked_bytes += frame;
            scan.first_unacked_off.get_or_insert(off);
        }
        off += frame;
        scan.valid_end = off;
    }
    Ok(scan)
}

/// Reads the `ack` file: the last acknowledged seq, 0 if none (or unreadable).
fn read_ack(dir: &Path) -> Result<u64, SpoolError> {
    let path = dir.join(ACK_FILE);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => {
            return Err(SpoolError::Io {
                op: "read",
                path,
                source: e,
            })
        }
    };
    if bytes.len() == ACK_BYTES
        && bytes[0..4] == ACK_MAGIC
        && crc32fast::hash(&bytes[0..12]) == le_u32(&bytes[12..16])
    {
        return Ok(le_u64(&bytes[4..12]));
    }
    tracing::warn!(
        path = %path.display(),
        len = bytes.len(),
        "spool: unreadable ack file ignored; every spooled entry will be replayed"
    );
    Ok(0)
}

/// A crash-safe on-disk FIFO of byte payloads; see the [module docs](self) for the format
/// and the guarantees. Not shared: one `Spool` per directory (it is `Send`, use it from one
/// thread at a time).
pub struct Spool {
    cfg: SpoolConfig,
    /// Holds the directory lock for as long as the spool lives.
    _lock: File,
    /// Oldest first; the front is read, the back is appended to.
    segments: VecDeque<Segment>,
    /// Append handle on the back segment.
    writer: Option<File>,
    /// Read handle on the front segment (by segment id).
    reader: Option<(u64, File)>,
    /// Offset of the oldest unacknowledged frame in the front segment.
    read_off: u64,
    /// Header of the oldest unacknowledged frame. `None` when empty (or, transiently, after
    /// a read error; it is then loaded again by the next `peek` / `ack` / `append`).
    head: Option<FrameHeader>,
    next_seq: u64,
    acked_seq: u64,
    len: u64,
    bytes: u64,
    corrupt_skipped: u64,
    corrupt_regions: u64,
    torn_bytes: u64,
    scratch: Vec<u8>,
}

impl std::fmt::Debug for Spool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spool")
            .field("dir", &self.cfg.dir)
            .field("segments", &self.segments.len())
            .field("len", &self.len)
            .field("bytes", &self.bytes)
            .field("next_seq", &self.next_seq)
            .field("acked_seq", &self.acked_seq)
            .field("corrupt_skipped", &self.corrupt_skipped)
            .field("torn_bytes", &self.torn_bytes)
            .finish()
    }
}

impl Spool {
    /// Opens (creating if needed) the spool in `cfg.dir`, locks it and recovers it: validates
    /// every frame, truncates a torn tail, skips corrupt regions, reads the ack position and
    /// deletes fully acknowledged segments (see the module docs).
    ///
    /// Fails with [`SpoolError::Locked`] if another `Spool` has the directory open.
    pub fn open(cfg: SpoolConfig) -> Result<Spool, SpoolError> {
        let dir = cfg.dir.clone();
        fs::create_dir_all(&dir).map_err(io_err("create directory", &dir))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(io_err("open", &lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Err(SpoolError::Locked { dir }),
            Err(TryLockError::Error(e)) => {
                return Err(SpoolError::Io {
                    op: "lock",
                    path: lock_path,
                    source: e,
                })
            }
        }
        probe_write(&dir)?;
        let tmp = dir.join(ACK_TMP_FILE);
        match fs::remove_file(&tmp) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(SpoolError::Io {
                    op: "remove",
                    path: tmp,
                    source: e,
                })
            }
        }
        let acked_seq = read_ack(&dir)?;
        let mut ids = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io_err("list", &dir))? {
            let entry = entry.map_err(io_err("list", &dir))?;
            if let Some(id) = entry.file_name().to_str().and_then(parse_segment_name) {
                ids.push(id);
            }
        }
        ids.sort_unstable();

        let mut spool = Spool {
            cfg,
            _lock: lock,
            segments: VecDeque::with_capacity(ids.len()),
            writer: None,
            reader: None,
            read_off: 0,
            head: None,
            next_seq: 1,
            acked_seq,
            len: 0,
            bytes: 0,
            corrupt_skipped: 0,
            corrupt_regions: 0,
            torn_bytes: 0,
            scratch: Vec::new(),
        };
        spool.recover(&ids)?;
        Ok(spool)
    }

    fn recover(&mut self, ids: &[u64]) -> Result<(), SpoolError> {
        let mut prev_seq: Option<u64> = None;
        let mut first_unacked: Vec<Option<u64>> = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let newest = i + 1 == ids.len();
            let path = self.cfg.dir.join(segment_name(id));
            let scan = scan_segment(&path, prev_seq, self.acked_seq)?;
            if let Some(stop) = &scan.stop {
                let cut = scan.file_len - scan.valid_end;
                match stop {
                    ScanStop::Torn(reason) if newest => {
                        self.torn_bytes += cut;
                        tracing::warn!(
                            path = %path.display(),
                            offset = scan.valid_end,
                            bytes = cut,
                            reason = %reason,
                            "spool: torn tail (interrupted append) truncated"
                        );
                    }
                    ScanStop::Torn(reason) | ScanStop::Corrupt(reason) => {
                        self.corrupt_skipped += cut;
                        self.corrupt_regions += 1;
                        tracing::warn!(
                            path = %path.display(),
                            offset = scan.valid_end,
                            bytes = cut,
                            reason = %reason,
                            "spool: corrupt frame; the rest of the segment is skipped"
                        );
                    }
                }
                if newest {
                    let file = OpenOptions::new()
                        .write(true)
                        .open(&path)
                        .map_err(io_err("open", &path))?;
                    file.set_len(scan.valid_end)
                        .map_err(io_err("truncate", &path))?;
                    if self.cfg.fsync {
                        file.sync_all().map_err(io_err("sync", &path))?;
                    }
                }
            }
            if scan.last_seq.is_some() {
                prev_seq = scan.last_seq;
            }
            self.len += scan.entries;
            self.bytes += scan.unacked_bytes;
            first_unacked.push(scan.first_unacked_off);
            self.segments.push_back(Segment {
                id,
                path,
                size: scan.valid_end,
                entries: scan.entries,
                unacked_bytes: scan.unacked_bytes,
                sealed: false,
            });
        }
        let newest_id = self.segments.back().map_or(0, |s| s.id);
        self.next_seq = prev_seq
            .unwrap_or(0)
            .max(self.acked_seq)
            .saturating_add(1)
            .max(newest_id)
            .max(1);
        // Drop fully acknowledged (or fully corrupt) segments; position the read end on the
        // oldest unacknowledged frame.
        let mut removed = false;
        let mut first = first_unacked.into_iter();
        while let Some(front) = self.segments.front() {
            let off = first.next().flatten();
            if front.entries == 0 && self.segments.len() > 1 {
                self.remove_front();
                removed = true;
                continue;
            }
            self.read_off = off.unwrap_or(front.size);
            break;
        }
        if removed && self.cfg.fsync {
            self.sync_dir()?;
        }
        self.load_head()
    }

    /// Appends one entry. Returns [`Append::Full`] (writing nothing) if its frame
    /// ([`FRAME_HEADER_BYTES`]` + payload.len()`) would take [`Spool::bytes`] past
    /// [`SpoolConfig::max_bytes`]. With [`SpoolConfig::fsync`] the frame is on stable
    /// storage when this returns `Appended`.
    ///
    /// On an error nothing was appended (a partially written frame is truncated away, or
    /// its segment is closed for appends so the next append starts a new one).
    pub fn append(&mut self, payload: &[u8]) -> Result<Append, SpoolError> {
        let len = u32::try_from(payload.len())
            .map_err(|_| SpoolError::PayloadTooLarge { len: payload.len() })?;
        let frame = FRAME_HEADER_BYTES + u64::from(len);
        if self.bytes.saturating_add(frame) > self.cfg.max_bytes {
            return Ok(Append::Full);
        }
        self.prepare_writer(frame)?;
        let seq = self.next_seq;
        let header = FrameHeader::new(seq, now_ms(), len, payload);
        let hb = header.encode();
        let (Some(back), Some(writer)) = (self.segments.back_mut(), self.writer.as_mut()) else {
            return Err(SpoolError::Io {
                op: "append to",
                path: self.cfg.dir.clone(),
                source: io::Error::other("no open segment"),
            });
        };
        let frame_off = back.size;
        let written = if payload.len() <= COALESCE_BYTES {
            self.scratch.clear();
            self.scratch.extend_from_slice(&hb);
            self.scratch.extend_from_slice(payload);
            writer.write_all(&self.scratch)
        } else {
            writer
                .write_all(&hb)
                .and_then(|()| writer.write_all(payload))
        }
        .and_then(|()| {
            if self.cfg.fsync {
                writer.sync_data()
            } else {
                Ok(())
            }
        });
        if let Err(source) = written {
            let path = back.path.clone();
            self.abandon_partial_write(frame_off);
            return Err(SpoolError::Io {
                op: "append to",
                path,
                source,
            });
        }
        back.size += frame;
        back.entries += 1;
        back.unacked_bytes += frame;
        let was_empty = self.len == 0;
        self.len += 1;
        self.bytes += frame;
        self.next_seq += 1;
        if was_empty {
            if self.segments.len() == 1 && self.read_off == frame_off {
                self.head = Some(header);
            } else if let Err(e) = self.load_head() {
                tracing::warn!(error = %e, "spool: reading the oldest entry failed; retried on the next call");
            }
        }
        Ok(Append::Appended { seq })
    }

    /// The oldest unacknowledged entry, read from disk (one frame; its checksum is
    /// verified), or `None` if the spool is empty. It stays in the spool until
    /// [`Spool::ack`]; only its header is kept in memory, so peeking again reads it again. A frame found damaged here is handled like corruption at recovery:
    /// the rest of its segment is skipped (counted in [`Spool::corrupt_skipped`]) and the
    /// next readable entry is returned.
    pub fn peek(&mut self) -> Result<Option<SpoolEntry>, SpoolError> {
        loop {
            if self.head.is_none() {
                if self.len == 0 {
                    return Ok(None);
                }
                self.load_head()?;
                if self.head.is_none() {
                    return Ok(None);
                }
            }
            match self.read_front(true)? {
                FrameRead::Valid {
                    header,
                    payload: Some(payload),
                } if Some(header) == self.head => {
                    return Ok(Some(SpoolEntry {
                        seq: header.seq,
                        appended_at_ms: header.appended_at_ms,
                        payload,
                    }))
                }
                FrameRead::Valid { .. } => {
                    self.skip_rest_of_front("frame changed on disk since it was first read")
                }
                FrameRead::Corrupt(reason) => self.skip_rest_of_front(&reason),
            }
            self.load_head()?;
        }
    }

    /// Acknowledges the oldest unacknowledged entry, `seq` (as returned by [`Spool::peek`]):
    /// it is removed, and the acknowledgement is persisted (atomically, synced with
    /// [`SpoolConfig::fsync`]) before this returns, so the entry is never replayed after a
    /// restart. Segments left with no unacknowledged entry (other than the newest) are
    /// deleted.
    ///
    /// Fails with [`SpoolError::AckOutOfOrder`] if `seq` is not the oldest entry's; on any
    /// error nothing changed and the call can be repeated.
    pub fn ack(&mut self, seq: u64) -> Result<(), SpoolError> {
        if self.head.is_none() && self.len > 0 {
            self.load_head()?;
        }
        let head = match self.head {
            Some(h) if h.seq == seq => h,
            other => {
                return Err(SpoolError::AckOutOfOrder {
                    got: seq,
                    oldest: other.map(|h| h.seq),
                })
            }
        };
        self.persist_ack(seq)?;
        self.acked_seq = seq;
        let frame = head.frame_bytes();
        self.read_off += frame;
        if let Some(front) = self.segments.front_mut() {
            front.entries = front.entries.saturating_sub(1);
            front.unacked_bytes = front.unacked_bytes.saturating_sub(frame);
        }
        self.len = self.len.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(frame);
        if let Err(e) = self.load_head() {
            tracing::warn!(error = %e, "spool: reading the next entry failed; retried on the next call");
        }
        Ok(())
    }

    /// Unacknowledged entries.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// No unacknowledged entry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the unacknowledged entries' frames, headers included (what
    /// [`SpoolConfig::max_bytes`] caps).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// When the oldest unacknowledged entry was appended (unix ms); `None` when empty.
    pub fn oldest_appended_at_ms(&self) -> Option<u64> {
        self.head.map(|h| h.appended_at_ms)
    }

    /// **Bytes** dropped as corrupt by this `Spool` (at recovery, or found by `peek`): from
    /// each invalid frame to the end of its segment. A torn tail is not corruption; see
    /// [`Spool::torn_bytes`]. Entries lost in those bytes cannot be counted.
    pub fn corrupt_skipped(&self) -> u64 {
        self.corrupt_skipped
    }

    /// Number of corrupt regions (one per segment where corruption was found) behind
    /// [`Spool::corrupt_skipped`].
    pub fn corrupt_regions(&self) -> u64 {
        self.corrupt_regions
    }

    /// Bytes of the torn tail (an append interrupted by a crash) truncated at recovery.
    pub fn torn_bytes(&self) -> u64 {
        self.torn_bytes
    }

    /// The sequence number the next append gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The last durably acknowledged sequence number (0: none).
    pub fn acked_seq(&self) -> u64 {
        self.acked_seq
    }

    /// Number of segment files.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// The spool directory.
    pub fn dir(&self) -> &Path {
        &self.cfg.dir
    }

    /// Makes sure the back segment can take a frame of `frame` bytes, starting a new
    /// segment if needed, and that the append handle is open.
    fn prepare_writer(&mut self, frame: u64) -> Result<(), SpoolError> {
        let roll = match self.segments.back() {
            None => true,
            Some(b) => {
                b.sealed || (b.size > 0 && b.size.saturating_add(frame) > self.cfg.segment_bytes)
            }
        };
        if roll {
            return self.roll();
        }
        if self.writer.is_none() {
            if let Some(back) = self.segments.back() {
                let file = OpenOptions::new()
                    .append(true)
                    .open(&back.path)
                    .map_err(io_err("open", &back.path))?;
                self.writer = Some(file);
            }
        }
        Ok(())
    }

    /// Starts a new (empty) segment and makes it the append target.
    fn roll(&mut self) -> Result<(), SpoolError> {
        let id = match self.segments.back() {
            Some(b) => self.next_seq.max(b.id.saturating_add(1)),
            None => self.next_seq,
        };
        let path = self.cfg.dir.join(segment_name(id));
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err("create", &path))?;
        if let Some(old) = self.segments.back_mut() {
            old.sealed = true;
        }
        self.writer = Some(file);
        self.segments.push_back(Segment {
            id,
            path,
            size: 0,
            entries: 0,
            unacked_bytes: 0,
            sealed: false,
        });
        self.remove_consumed_fronts();
        if self.cfg.fsync {
            self.sync_dir()?;
        }
        Ok(())
    }

    /// After a failed write: cut the back segment back to its last complete frame, or if
    /// that fails too, stop appending to it.
    fn abandon_partial_write(&mut self, frame_off: u64) {
        self.writer = None;
        let Some(back) = self.segments.back_mut() else {
            return;
        };
        let truncated = OpenOptions::new()
            .write(true)
            .open(&back.path)
            .and_then(|f| f.set_len(frame_off));
        if let Err(e) = truncated {
            tracing::warn!(
                path = %back.path.display(),
                error = %e,
                "spool: could not truncate a failed append; the segment is closed for appends"
            );
            back.sealed = true;
        }
    }

    /// Reads the frame at the read position of the front segment.
    fn read_front(&mut self, with_payload: bool) -> Result<FrameRead, SpoolError> {
        let Some(front) = self.segments.front() else {
            return Ok(FrameRead::Corrupt("no segment".to_owned()));
        };
        let (id, size) = (front.id, front.size);
        if !matches!(&self.reader, Some((rid, _)) if *rid == id) {
            let file = File::open(&front.path).map_err(io_err("open", &front.path))?;
            self.reader = Some((id, file));
        }
        let Some((_, file)) = self.reader.as_mut() else {
            return Ok(FrameRead::Corrupt("no read handle".to_owned()));
        };
        let off = self.read_off;
        read_frame_at(file, off, size, with_payload).map_err(|source| SpoolError::Io {
            op: "read",
            path: self.cfg.dir.join(segment_name(id)),
            source,
        })
    }

    /// Positions `head` on the oldest unacknowledged frame (reading its header), deleting
    /// consumed segments on the way and skipping corrupt ones. Terminates: every iteration
    /// returns, removes a segment, or ends the front segment.
    fn load_head(&mut self) -> Result<(), SpoolError> {
        self.head = None;
        loop {
            self.remove_consumed_fronts();
            let Some(front) = self.segments.front() else {
                return Ok(());
            };
            if self.read_off >= front.size {
                return Ok(());
            }
            match self.read_front(false)? {
                FrameRead::Valid { header, .. } if header.seq > self.acked_seq => {
                    self.head = Some(header);
                    return Ok(());
                }
                FrameRead::Valid { header, .. } => self.skip_rest_of_front(&format!(
                    "unacknowledged frame has seq {} <= acknowledged seq {}",
                    header.seq, self.acked_seq
                )),
                FrameRead::Corrupt(reason) => self.skip_rest_of_front(&reason),
            }
        }
    }

    /// Drops the rest of the front segment as corrupt.
    fn skip_rest_of_front(&mut self, reason: &str) {
        let single = self.segments.len() == 1;
        let Some(front) = self.segments.front_mut() else {
            return;
        };
        let skipped = front.size.saturating_sub(self.read_off);
        tracing::warn!(
            path = %front.path.display(),
            offset = self.read_off,
            bytes = skipped,
            entries = front.entries,
            reason = %reason,
            "spool: corrupt frame; the rest of the segment is skipped"
        );
        self.corrupt_skipped += skipped;
        self.corrupt_regions += 1;
        self.len = self.len.saturating_sub(front.entries);
        self.bytes = self.bytes.saturating_sub(front.unacked_bytes);
        front.entries = 0;
        front.unacked_bytes = 0;
        self.read_off = front.size;
        self.head = None;
        if single {
            // Appends must not land behind the damage: the next one starts a new segment.
            front.sealed = true;
            self.writer = None;
        }
    }

    /// Deletes front segments that are fully read and are not the newest.
    fn remove_consumed_fronts(&mut self) {
        while self.segments.len() > 1
            && self
                .segments
                .front()
                .is_some_and(|f| self.read_off >= f.size)
        {
            self.remove_front();
        }
    }

    fn remove_front(&mut self) {
        let Some(front) = self.segments.pop_front() else {
            return;
        };
        if matches!(&self.reader, Some((rid, _)) if *rid == front.id) {
            self.reader = None;
        }
        self.read_off = 0;
        if let Err(e) = fs::remove_file(&front.path) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(
                    path = %front.path.display(),
                    error = %e,
                    "spool: could not delete an acknowledged segment; retried at the next open"
                );
            }
        }
    }

    /// Writes the ack position: temp file, sync, rename, directory sync.
    fn persist_ack(&mut self, seq: u64) -> Result<(), SpoolError> {
        let tmp = self.cfg.dir.join(ACK_TMP_FILE);
        let dst = self.cfg.dir.join(ACK_FILE);
        let mut buf = [0u8; ACK_BYTES];
        buf[0..4].copy_from_slice(&ACK_MAGIC);
        buf[4..12].copy_from_slice(&seq.to_le_bytes());
        let crc = crc32fast::hash(&buf[0..12]);
        buf[12..16].copy_from_slice(&crc.to_le_bytes());
        {
            let mut f = File::create(&tmp).map_err(io_err("create", &tmp))?;
            f.write_all(&buf).map_err(io_err("write", &tmp))?;
            if self.cfg.fsync {
                f.sync_data().map_err(io_err("sync", &tmp))?;
            }
        }
        fs::rename(&tmp, &dst).map_err(io_err("rename", &dst))?;
        if self.cfg.fsync {
            self.sync_dir()?;
        }
        Ok(())
    }

    /// Makes file creations, renames and deletions in the directory durable.
    fn sync_dir(&self) -> Result<(), SpoolError> {
        #[cfg(unix)]
        {
            let dir = &self.cfg.dir;
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io_err("sync", dir))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg(dir: &Path, segment_bytes: u64, max_bytes: u64, fsync: bool) -> SpoolConfig {
        SpoolConfig {
            dir: dir.to_path_buf(),
            max_bytes,
            segment_bytes,
            fsync,
        }
    }

    fn payload(i: u64, len: usize) -> Vec<u8> {
        (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
    }

    fn frame(len: usize) -> u64 {
        FRAME_HEADER_BYTES + len as u64
    }

    fn seq_of(a: Append) -> u64 {
        match a {
            Append::Appended { seq } => seq,
            Append::Full => panic!("unexpected Full"),
        }
    }

    /// Segment files, oldest first.
    fn segment_files(dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = fs::read_dir(dir)
            .expect("list")
            .map(|e| e.expect("entry").path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(parse_segment_name)
                    .is_some()
            })
            .collect();
        v.sort();
        v
    }

    fn file_len(p: &Path) -> u64 {
        fs::metadata(p).expect("stat").len()
    }

    fn flip_byte(p: &Path, at: u64) {
        let mut bytes = fs::read(p).expect("read");
        bytes[at as usize] ^= 0x5a;
        fs::write(p, bytes).expect("write");
    }

    /// Peeks and acks everything, returning (seq, payload) in order.
    fn drain(s: &mut Spool) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        while let Some(e) = s.peek().expect("peek") {
            assert_eq!(s.oldest_appended_at_ms(), Some(e.appended_at_ms));
            s.ack(e.seq).expect("ack");
            out.push((e.seq, e.payload));
        }
        assert_eq!(s.len(), 0);
        assert_eq!(s.bytes(), 0);
        assert!(s.is_empty());
        assert_eq!(s.oldest_appended_at_ms(), None);
        out
    }

    #[test]
    fn spool_is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<Spool>();
    }

    #[test]
    fn defaults() {
        let c = SpoolConfig::default();
        assert_eq!(c.dir, PathBuf::from("./tokenscope-spool"));
        assert_eq!(c.max_bytes, 1 << 30);
        assert_eq!(c.segment_bytes, 64 << 20);
        assert!(c.fsync);
        assert_eq!(segment_name(1), "00000000000000000001.seg");
        assert_eq!(parse_segment_name("00000000000000000042.seg"), Some(42));
        assert_eq!(parse_segment_name("42.seg"), None);
        assert_eq!(parse_segment_name("0000000000000000004x.seg"), None);
    }

    #[test]
    fn round_trip_across_segment_rolls() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Spool::open(cfg(dir.path(), 512, 1 << 20, true)).expect("open");
        assert!(s.is_empty());
        assert_eq!(s.peek().expect("peek"), None);
        let lens: Vec<usize> = (0..40u64)
            .map(|i| ((i * 37) % 300) as usize)
            .chain([0, 2000])
            .collect();
        let mut expected_bytes = 0;
        let before = now_ms();
        for (i, &len) in lens.iter().enumerate() {
            let seq = seq_of(s.append(&payload(i as u64, len)).expect("append"));
            assert_eq!(seq, i as u64 + 1);
            expected_bytes += frame(len);
            assert_eq!(s.len(), i as u64 + 1);
            assert_eq!(s.bytes(), expected_bytes);
        }
        let oldest = s.oldest_appended_at_ms().expect("oldest");
        assert!(oldest >= before && oldest <= now_ms());
        let files = segment_files(dir.path());
        assert!(files.len() >= 10, "{} segments", files.len());
        assert_eq!(files.len(), s.segment_count());
        for f in &files[..files.len() - 1] {
            // Only a frame larger than segment_bytes may exceed it.
            assert!(file_len(f) <= 512 || file_len(f) == frame(2000));
        }
        // The 2000-byte payload sits alone in its segment.
        assert_eq!(file_len(files.last().expect("last")), frame(2000));
        assert_eq!(
            files.iter().map(|f| file_len(f)).sum::<u64>(),
            expected_bytes
        );
        let got = drain(&mut s);
        assert_eq!(got.len(), lens.len());
        for (i, (seq, p)) in got.iter().enumerate() {
            assert_eq!(*seq, i as u64 + 1);
            assert_eq!(*p, payload(i as u64, lens[i]));
        }
        assert_eq!(s.acked_seq(), lens.len() as u64);
        assert_eq!(s.corrupt_skipped(), 0);
        assert_eq!(s.torn_bytes(), 0);
    }

    #[test]
    fn ack_deletes_segments() {
        let dir = tempfile::tempdir().expect("tempdir");
        // 100-byte payloads: 128-byte frames, exactly 2 per 256-byte segment.
        let mut s = Spool::open(cfg(dir.path(), 256, 1 << 20, false)).expect("open");
        for i in 0..6 {
            s.append(&payload(i, 100)).expect("append");
        }
        assert_eq!(segment_files(dir.path()).len(), 3);
        let mut counts = Vec::new();
        for seq in 1..=6 {
            let e = s.peek().expect("peek").expect("entry");
            assert_eq!(e.seq, seq);
            s.ack(seq).expect("ack");
            counts.push(segment_files(dir.path()).len());
        }
        // A segment goes when its last entry is acked; the newest one stays.
        assert_eq!(counts, vec![3, 2, 2, 1, 1, 1]);
        assert_eq!(s.segment_count(), 1);
        // The next append that does not fit rolls and deletes the fully acked one.
        s.append(&payload(7, 100)).expect("append");
        assert_eq!(segment_files(dir.path()).len(), 1);
        assert_eq!(file_len(&segment_files(dir.path())[0]), 128);
        assert_eq!(drain(&mut s), vec![(7, payload(7, 100))]);
    }

    #[test]
    fn reopen_continues_seq_and_never_replays_acked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = cfg(dir.path(), 300, 1 << 20, true);
        {
            let mut s = Spool::open(c.clone()).expect("open");
            for i in 1..=5 {
                assert_eq!(seq_of(s.append(&payload(i, 90)).expect("append")), i);
            }
            s.ack(1).expect("ack 1 without peek");
            let e = s.peek().expect("peek").expect("entry");
            assert_eq!(e.seq, 2);
            s.ack(2).expect("ack 2");
            // Dropped without any shutdown step: same as a crash for the spool.
        }
        {
            let mut s = Spool::open(c.clone()).expect("reopen");
            assert_eq!(s.len(), 3);
            assert_eq!(s.bytes(), 3 * frame(90));
            assert_eq!(s.acked_seq(), 2);
            assert_eq!(s.next_seq(), 6);
            assert_eq!(s.peek().expect("peek").map(|e| e.seq), Some(3));
            assert_eq!(seq_of(s.append(&payload(6, 10)).expect("append")), 6);
            let got = drain(&mut s);
            assert_eq!(
                got,
                vec![
                    (3, payload(3, 90)),
                    (4, payload(4, 90)),
                    (5, payload(5, 90)),
                    (6, payload(6, 10))
                ]
            );
        }
        {
            let mut s = Spool::open(c).expect("reopen");
            assert!(s.is_empty());
            assert_eq!(s.peek().expect("peek"), None);
            assert_eq!(seq_of(s.append(b"x").expect("append")), 7);
        }
    }

    #[test]
    fn seq_continues_when_every_segment_is_gone() {
        // Only the ack file says where numbering was: seq still never goes back.
        let dir = tempfile::tempdir().expect("tempdir");
        let c = cfg(dir.path(), 1 << 20, 1 << 20, false);
        {
            let mut s = Spool::open(c.clone()).expect("open");
            for i in 1..=3 {
                s.append(&payload(i, 5)).expect("append");
            }
            drain(&mut s);
        }
        for f in segment_files(dir.path()) {
            fs::remove_file(f).expect("rm");
        }
        let mut s = Spool::open(c).expect("reopen");
        assert_eq!(seq_of(s.append(b"y").expect("append")), 4);
    }

    #[test]
    fn ack_out_of_order_is_rejected_and_changes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Spool::open(cfg(dir.path(), 1 << 20, 1 << 20, false)).expect("open");
        assert!(matches!(
            s.ack(1),
            Err(SpoolError::AckOutOfOrder {
                got: 1,
                oldest: None
            })
        ));
        s.append(b"a").expect("append");
        s.append(b"b").expect("append");
        assert!(matches!(
            s.ack(2),
            Err(SpoolError::AckOutOfOrder {
                got: 2,
                oldest: Some(1)
            })
        ));
        assert_eq!(s.len(), 2);
        assert_eq!(s.acked_seq(), 0);
        assert!(!dir.path().join(ACK_FILE).exists());
        assert_eq!(drain(&mut s), vec![(1, b"a".to_vec()), (2, b"b".to_vec())]);
    }

    #[test]
    fn torn_tail_at_every_offset_recovers_earlier_entries() {
        let last_len = 60usize;
        let last_frame = frame(last_len);
        let lens = [100usize, 10, 200, 150, last_len];
        for keep in 0..last_frame {
            let dir = tempfile::tempdir().expect("tempdir");
            let c = cfg(dir.path(), 300, 1 << 20, false);
            {
                let mut s = Spool::open(c.clone()).expect("open");
                for (i, &len) in lens.iter().enumerate() {
                    s.append(&payload(i as u64, len)).expect("append");
                }
                s.ack(1).expect("ack");
            }
            let files = segment_files(dir.path());
            let last = files.last().expect("segment");
            let full = file_len(last);
            fs::OpenOptions::new()
                .write(true)
                .open(last)
                .expect("open seg")
                .set_len(full - last_frame + keep)
                .expect("truncate");
            let mut s = Spool::open(c).expect("reopen");
            assert_eq!(s.torn_bytes(), keep, "keep {keep}");
            assert_eq!(s.corrupt_skipped(), 0);
            assert_eq!(s.len(), 3);
            assert_eq!(s.bytes(), frame(10) + frame(200) + frame(150));
            assert_eq!(file_len(last), full - last_frame);
            // The lost entry's number is handed out again; nothing else ever had it.
            assert_eq!(seq_of(s.append(b"after").expect("append")), 5);
            let got = drain(&mut s);
            assert_eq!(
                got,
                vec![
                    (2, payload(1, 10)),
                    (3, payload(2, 200)),
                    (4, payload(3, 150)),
                    (5, b"after".to_vec())
                ]
            );
        }
    }

    #[test]
    fn checksum_bad_last_frame_is_a_torn_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = cfg(dir.path(), 1 << 20, 1 << 20, false);
        {
            let mut s = Spool::open(c.clone()).expect("open");
            s.append(&payload(1, 50)).expect("append");
            s.append(&payload(2, 50)).expect("append");
        }
        let seg = &segment_files(dir.path())[0];
        flip_byte(seg, frame(50) + FRAME_HEADER_BYTES + 10);
        let mut s = Spool::open(c).expect("reopen");
        assert_eq!(s.torn_bytes(), frame(50));
        assert_eq!(s.corrupt_skipped(), 0);
        assert_eq!(drain(&mut s), vec![(1, payload(1, 50))]);
    }

    #[test]
    fn corrupt_middle_byte_is_skipped_and_counted() {
        // 3 frames of 128 bytes per segment, 3 segments.
        let build = |dir: &Path| {
            let mut s = Spool::open(cfg(dir, 384, 1 << 20, false)).expect("open");
            for i in 1..=9 {
                s.append(&payload(i, 100)).expect("append");
            }
            assert_eq!(segment_files(dir).len(), 3);
        };
        let expect = |seqs: &[u64]| -> Vec<(u64, Vec<u8>)> {
            seqs.iter().map(|&i| (i, payload(i, 100))).collect()
        };

        // A payload byte of entry 2 (middle of the oldest segment): 2 and 3 are skipped.
        let dir = tempfile::tempdir().expect("tempdir");
        build(dir.path());
        flip_byte(&segment_files(dir.path())[0], 128 + 28 + 50);
        let mut s = Spool::open(cfg(dir.path(), 384, 1 << 20, false)).expect("reopen");
        assert_eq!(s.corrupt_skipped(), 256);
        assert_eq!(s.corrupt_regions(), 1);
        assert_eq!(s.torn_bytes(), 0);
        assert_eq!(s.len(), 7);
        assert_eq!(s.bytes(), 7 * 128);
        assert_eq!(drain(&mut s), expect(&[1, 4, 5, 6, 7, 8, 9]));
        drop(s);

        // The magic of entry 5 (middle of the middle segment): 5 and 6 are skipped.
        let dir = tempfile::tempdir().expect("tempdir");
        build(dir.path());
        flip_byte(&segment_files(dir.path())[1], 128);
        let mut s = Spool::open(cfg(dir.path(), 384, 1 << 20, false)).expect("reopen");
        assert_eq!(s.corrupt_skipped(), 256);
        assert_eq!(s.corrupt_regions(), 1);
        assert_eq!(drain(&mut s), expect(&[1, 2, 3, 4, 7, 8, 9]));
        drop(s);

        // The length of entry 8 (middle of the newest segment; still within the file, so
        // the checksum catches it): cut there, appends go on. (A length running past the
        // end of the newest segment is indistinguishable from a torn append: torn_bytes.)
        let dir = tempfile::tempdir().expect("tempdir");
        build(dir.path());
        let newest = segment_files(dir.path())[2].clone();
        flip_byte(&newest, 128 + 4);
        let mut s = Spool::open(cfg(dir.path(), 384, 1 << 20, false)).expect("reopen");
        assert_eq!(s.corrupt_skipped(), 256);
        assert_eq!(s.corrupt_regions(), 1);
        assert_eq!(s.torn_bytes(), 0);
        assert_eq!(file_len(&newest), 128);
        assert_eq!(seq_of(s.append(&payload(8, 100)).expect("append")), 8);
        assert_eq!(drain(&mut s), expect(&[1, 2, 3, 4, 5, 6, 7, 8]));
    }

    #[test]
    fn corruption_found_by_peek_is_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Spool::open(cfg(dir.path(), 384, 1 << 20, false)).expect("open");
        for i in 1..=6 {
            s.append(&payload(i, 100)).expect("append");
        }
        // Damage entry 2 (oldest segment) and entry 5 (newest segment) under the open spool.
        let files = segment_files(dir.path());
        flip_byte(&files[0], 128 + 28 + 1);
        flip_byte(&files[1], 128 + 28 + 1);
        let e = s.peek().expect("peek").expect("entry");
        assert_eq!(e.seq, 1);
        s.ack(1).expect("ack");
        let e = s.peek().expect("peek").expect("entry");
        assert_eq!(
            e,
            SpoolEntry {
                seq: 4,
                appended_at_ms: e.appended_at_ms,
                payload: payload(4, 100)
            }
        );
        assert_eq!(s.corrupt_skipped(), 256);
        assert_eq!(s.len(), 3);
        s.ack(4).expect("ack");
        // Entry 5 is damaged in the newest segment: 5 and 6 go, and appends move on to a
        // fresh segment instead of landing behind the damage.
        assert_eq!(s.peek().expect("peek"), None);
        assert_eq!(s.corrupt_skipped(), 512);
        assert_eq!(s.corrupt_regions(), 2);
        assert!(s.is_empty());
        assert_eq!(seq_of(s.append(b"fresh").expect("append")), 7);
        assert_eq!(segment_files(dir.path()).len(), 1);
        assert_eq!(drain(&mut s), vec![(7, b"fresh".to_vec())]);
    }

    #[test]
    fn full_at_the_cap_and_appends_again_after_acks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Spool::open(cfg(dir.path(), 1 << 20, 3 * 128, false)).expect("open");
        for i in 1..=3 {
            assert_eq!(
                s.append(&payload(i, 100)).expect("append"),
                Append::Appended { seq: i }
            );
        }
        assert_eq!(s.bytes(), 384);
        let seg = segment_files(dir.path())[0].clone();
        assert_eq!(s.append(&payload(4, 100)).expect("append"), Append::Full);
        assert_eq!(s.append(&[]).expect("append"), Append::Full);
        assert_eq!(file_len(&seg), 384);
        assert_eq!(s.len(), 3);
        s.ack(1).expect("ack");
        // 128 free: a 101-byte payload does not fit, a 100-byte one does.
        assert_eq!(s.append(&payload(4, 101)).expect("append"), Append::Full);
        assert_eq!(
            s.append(&payload(4, 100)).expect("append"),
            Append::Appended { seq: 4 }
        );
        assert_eq!(s.append(b"").expect("append"), Append::Full);
        assert_eq!(s.bytes(), 384);
        // Larger than the whole cap: never fits.
        drain(&mut s);
        assert_eq!(s.append(&payload(9, 400)).expect("append"), Append::Full);
        assert_eq!(
            s.append(&payload(9, 356)).expect("append"),
            Append::Appended { seq: 5 }
        );
    }

    #[test]
    fn second_open_is_locked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = cfg(dir.path(), 1 << 20, 1 << 20, false);
        let s = Spool::open(c.clone()).expect("open");
        match Spool::open(c.clone()) {
            Err(SpoolError::Locked { dir: d }) => assert_eq!(d, dir.path()),
            other => panic!("expected Locked, got {other:?}"),
        }
        drop(s);
        Spool::open(c).expect("open after the first closed");
    }

    #[test]
    fn unreadable_ack_file_replays_everything() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = cfg(dir.path(), 1 << 20, 1 << 20, false);
        {
            let mut s = Spool::open(c.clone()).expect("open");
            s.append(b"a").expect("append");
            s.append(b"b").expect("append");
            s.ack(1).expect("ack");
        }
        fs::write(dir.path().join(ACK_TMP_FILE), b"stale").expect("write");
        assert_eq!(Spool::open(c.clone()).expect("reopen").len(), 1);
        assert!(!dir.path().join(ACK_TMP_FILE).exists());
        flip_byte(&dir.path().join(ACK_FILE), 5);
        let mut s = Spool::open(c).expect("reopen");
        assert_eq!(s.acked_seq(), 0);
        assert_eq!(drain(&mut s), vec![(1, b"a".to_vec()), (2, b"b".to_vec())]);
    }

    /// Append throughput of 10 MB payloads against a plain `write_all` of the same bytes
    /// (alternating, so page-cache effects hit both alike).
    /// `cargo test -p tokenscope-store --release spool::tests::append_throughput -- --ignored --nocapture`
    #[test]
    #[ignore = "measurement"]
    fn append_throughput() {
        let n = 30u64;
        let p = payload(3, 10_000_000);
        let mb = (n * 10) as f64;
        let t = std::time::Instant::now();
        let mut x = 0u32;
        for _ in 0..n {
            x ^= crc32fast::hash(&p);
        }
        println!(
            "crc32 alone: {:.0} MB/s ({x})",
            mb / t.elapsed().as_secs_f64()
        );
        for round in 0..2 {
            for fsync in [false, true] {
                let raw_dir = tempfile::tempdir().expect("tempdir");
                let mut f = File::create(raw_dir.path().join("raw")).expect("create");
                let t = std::time::Instant::now();
                for _ in 0..n {
                    f.write_all(&p).expect("write");
                    if fsync {
                        f.sync_data().expect("sync");
                    }
                }
                let raw_s = t.elapsed().as_secs_f64();
                drop((f, raw_dir));

                let dir = tempfile::tempdir().expect("tempdir");
                let mut s = Spool::open(cfg(dir.path(), 64 << 20, 1 << 30, fsync)).expect("open");
                let t = std::time::Instant::now();
                for _ in 0..n {
                    s.append(&p).expect("append");
                }
                let spool_s = t.elapsed().as_secs_f64();
                let t = std::time::Instant::now();
                let mut read = 0;
                while let Some(e) = s.peek().expect("peek") {
                    read += e.payload.len();
                    s.ack(e.seq).expect("ack");
                }
                let drain_s = t.elapsed().as_secs_f64();
                assert_eq!(read as u64, n * 10_000_000);
                println!(
                    "round {round} fsync={fsync}: raw write {:.0} MB/s, spool append {:.0} MB/s, peek+ack {:.0} MB/s",
                    mb / raw_s,
                    mb / spool_s,
                    mb / drain_s
                );
            }
        }
        // Small entries: the per-call cost of append and of ack (which renames the ack file).
        for fsync in [false, true] {
            let dir = tempfile::tempdir().expect("tempdir");
            let mut s = Spool::open(cfg(dir.path(), 64 << 20, 1 << 30, fsync)).expect("open");
            let k = 500u32;
            let t = std::time::Instant::now();
            for i in 0..k {
                s.append(&payload(u64::from(i), 1000)).expect("append");
            }
            let append_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(k);
            let t = std::time::Instant::now();
            while let Some(e) = s.peek().expect("peek") {
                s.ack(e.seq).expect("ack");
            }
            let ack_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(k);
            println!(
                "fsync={fsync}: 1 kB entries: append {append_us:.0} us, peek+ack {ack_us:.0} us"
            );
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Append(Vec<u8>),
        PeekAck,
        Reopen,
        /// Drop, then (with `Some(r)`) cut `r % (last frame + 1)` bytes off the newest segment.
        Crash(Option<u16>),
    }

    /// `len` pseudo-random bytes (xorshift64*): much cheaper to generate than a
    /// `vec(any::<u8>())` in a debug build, and shrinks through `len` and `seed`.
    fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
            })
            .collect()
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (0usize..2000, any::<u64>()).prop_map(|(len, seed)| Op::Append(random_bytes(len, seed))),
            4 => Just(Op::PeekAck),
            1 => Just(Op::Reopen),
            2 => any::<Option<u16>>().prop_map(Op::Crash),
        ]
    }

    const PROP_SEGMENT: u64 = 4096;
    const PROP_MAX: u64 = 9_000;

    fn check(s: &mut Spool, model: &VecDeque<(u64, Vec<u8>)>) -> Result<(), TestCaseError> {
        prop_assert_eq!(s.len(), model.len() as u64);
        prop_assert_eq!(s.is_empty(), model.is_empty());
        let bytes: u64 = model.iter().map(|(_, p)| frame(p.len())).sum();
        prop_assert_eq!(s.bytes(), bytes);
        prop_assert_eq!(s.corrupt_skipped(), 0);
        let peeked = s.peek().map_err(|e| TestCaseError::fail(e.to_string()))?;
        match (model.front(), peeked) {
            (None, None) => prop_assert_eq!(s.oldest_appended_at_ms(), None),
            (Some((seq, p)), Some(e)) => {
                prop_assert_eq!(e.seq, *seq);
                prop_assert_eq!(&e.payload, p);
                prop_assert_eq!(s.oldest_appended_at_ms(), Some(e.appended_at_ms));
            }
            (m, e) => prop_assert!(
                false,
                "model front {:?} vs peek {:?}",
                m.map(|x| x.0),
                e.map(|x| x.seq)
            ),
        }
        // Disk use stays within the documented bound.
        let disk: u64 = segment_files(s.dir()).iter().map(|f| file_len(f)).sum();
        prop_assert!(
            disk <= PROP_MAX + PROP_SEGMENT.max(frame(1999)),
            "disk {}",
            disk
        );
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
        #[test]
        fn spool_matches_in_memory_model(ops in prop::collection::vec(op(), 1..48)) {
            let dir = tempfile::tempdir().expect("tempdir");
            let c = cfg(dir.path(), PROP_SEGMENT, PROP_MAX, false);
            let mut spool = Some(Spool::open(c.clone()).expect("open"));
            let mut model: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
            let mut next_seq = 1u64;
            // The last appended entry (seq, frame bytes) while it is the newest segment's
            // last frame.
            let mut tail: Option<(u64, u64)> = None;
            for op in ops {
                let mut expected_torn = None;
                match op {
                    Op::Append(p) => {
                        let s = spool.as_mut().expect("spool");
                        let model_bytes: u64 = model.iter().map(|(_, p)| frame(p.len())).sum();
                        let got = s.append(&p).expect("append");
                        if model_bytes + frame(p.len()) > PROP_MAX {
                            prop_assert_eq!(got, Append::Full);
                        } else {
                            prop_assert_eq!(got, Append::Appended { seq: next_seq });
                            tail = Some((next_seq, frame(p.len())));
                            model.push_back((next_seq, p));
                            next_seq += 1;
                        }
                    }
                    Op::PeekAck => {
                        let s = spool.as_mut().expect("spool");
                        let e = s.peek().expect("peek");
                        match model.pop_front() {
                            None => prop_assert_eq!(e, None),
                            Some((seq, p)) => {
                                let e = e.expect("entry");
                                prop_assert_eq!(e.seq, seq);
                                prop_assert_eq!(e.payload, p);
                                s.ack(seq).expect("ack");
                            }
                        }
                    }
                    Op::Reopen => {
                        drop(spool.take());
                        spool = Some(Spool::open(c.clone()).expect("reopen"));
                        expected_torn = Some(0);
                    }
                    Op::Crash(cut) => {
                        drop(spool.take());
                        let mut torn = 0;
                        if let (Some(r), Some((seq, fb))) = (cut, tail) {
                            let k = u64::from(r) % (fb + 1);
                            if k > 0 {
                                let files = segment_files(dir.path());
                                let last = files.last().expect("segment");
                                let len = file_len(last);
                                prop_assert!(len >= fb);
                                fs::OpenOptions::new().write(true).open(last).expect("open")
                                    .set_len(len - k).expect("truncate");
                                torn = fb - k;
                                tail = None;
                                if model.back().map(|(s, _)| *s) == Some(seq) {
                                    model.pop_back();
                                    next_seq = seq;
                                }
                            }
                        }
                        spool = Some(Spool::open(c.clone()).expect("reopen after crash"));
                        expected_torn = Some(torn);
                    }
                }
                let s = spool.as_mut().expect("spool");
                if let Some(t) = expected_torn {
                    prop_assert_eq!(s.torn_bytes(), t);
                    prop_assert_eq!(s.next_seq(), next_seq);
                }
                check(s, &model)?;
            }
        }
    }
}
