//! Aligned buffers and positioned reads, through O_DIRECT where the filesystem
//! takes it and through the page cache where it does not.

use std::alloc::{Layout, alloc, dealloc, handle_alloc_error};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Alignment of every buffer, file offset and length handed to a direct read.
pub const ALIGN: usize = 4096;

pub(crate) fn align_down(x: u64) -> u64 {
    x & !(ALIGN as u64 - 1)
}

pub(crate) fn align_up(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// A zeroed, 4 KiB-aligned heap buffer of plain bytes that several threads may
/// read and write through raw slices.
///
/// It does no synchronisation itself: whoever takes a slice promises what the
/// `unsafe` accessors state. The store keeps that promise with the slot protocol
/// described in `cache.rs`: a byte range has at most one writer (the reader job
/// that owns that chunk of a loading slot), and nobody reads a range while it may
/// be written (a loading slot is never handed out, a pinned slot is never reloaded).
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// Where a device locked the pages (see [`crate::PageLocker`]): unlocked when
    /// dropped, before the memory is freed.
    locked: Option<Box<dyn Send + Sync>>,
}

// SAFETY: the buffer is plain bytes with no thread affinity; concurrent access goes
// through the unsafe accessors, whose callers guarantee the absence of data races.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; `&AlignedBuf` alone gives no access to the bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Zeroed and touched, so that its pages are committed now rather than
    /// faulted in by the first read into it.
    pub fn new(len: usize) -> AlignedBuf {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (at least one page).
        let ptr = unsafe { alloc(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| handle_alloc_error(layout));
        // SAFETY: `ptr` points to `layout.size()` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, layout.size()) };
        AlignedBuf { ptr, len, locked: None }
    }

    /// As [`AlignedBuf::new`], its pages then locked by `lock` where it can (the
    /// buffer stays pageable where it cannot: see [`AlignedBuf::is_locked`]).
    pub fn locked(len: usize, lock: &crate::PageLock) -> AlignedBuf {
        let mut b = AlignedBuf::new(len);
        b.locked = lock.0.lock(b.ptr.as_ptr(), Self::layout(len).size());
        b
    }

    pub fn is_locked(&self) -> bool {
        self.locked.is_some()
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(align_up(len.max(1)), ALIGN).expect("buffer size overflows")
    }

    /// Bytes `off..off + len`.
    ///
    /// # Safety
    /// No thread may write any of these bytes while the returned slice lives.
    pub unsafe fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len), "slice out of the buffer");
        // SAFETY: in bounds (checked), initialised (zeroed at allocation), and the
        // caller guarantees no concurrent writer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// Bytes `off..off + len`, writable.
    ///
    /// # Safety
    /// No other thread may read or write any of these bytes while the returned
    /// slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len), "slice out of the buffer");
        // SAFETY: in bounds (checked), initialised, and the caller guarantees
        // exclusive access to the range.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // Unlocked first: a device must let go of the pages before they are freed.
        drop(self.locked.take());
        // SAFETY: allocated in `new` with this very layout.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

/// Asks the kernel to start reading the pages under `bytes`, a range of a live
/// read-only mapping, into the page cache. Only a hint: errors are ignored.
pub(crate) fn will_need(bytes: &[u8]) {
    // SAFETY: sysconf has no preconditions.
    let page_size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
    let start = bytes.as_ptr() as usize;
    let page = start - start % page_size;
    // SAFETY: MADV_WILLNEED changes neither the contents nor the validity of any
    // memory; the range (widened to whole pages, which a mapping always spans)
    // lies inside the mapping `bytes` borrows from, which outlives the call.
    unsafe {
        libc::madvise(page as *mut libc::c_void, start - page + bytes.len(), libc::MADV_WILLNEED);
    }
}

/// Whether reads bypass the page cache, and why not where they do not.
#[derive(Default)]
pub(crate) struct DirectStatus {
    pub requested: bool,
    /// The first reason direct reads were given up, with the file it happened on.
    pub fallback: Mutex<Option<String>>,
}

impl DirectStatus {
    fn fell_back(&self, reason: String) {
        let mut r = self.fallback.lock().unwrap();
        if r.is_none() {
            *r = Some(reason);
        }
    }
}

/// One checkpoint file opened for positioned reads: a buffered descriptor always,
/// and an O_DIRECT one where asked for and allowed.
pub(crate) struct FileHandle {
    pub path: PathBuf,
    buffered: File,
    direct: Option<File>,
    direct_on: AtomicBool,
}

impl FileHandle {
    pub fn open(path: &Path, want_direct: bool, status: &DirectStatus) -> io::Result<FileHandle> {
        let buffered = File::open(path)?;
        let direct = if want_direct {
            match OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
                Ok(f) => Some(f),
                Err(e) => {
                    status.fell_back(format!(
                        "{}: O_DIRECT open failed ({e}); reading through the page cache",
                        path.display()
                    ));
                    None
                }
            }
        } else {
            None
        };
        let direct_on = AtomicBool::new(direct.is_some());
        Ok(FileHandle { path: path.to_path_buf(), buffered, direct, direct_on })
    }

    pub fn is_direct(&self) -> bool {
        self.direct_on.load(Ordering::Relaxed)
    }

    /// Reads into `dst` from `off`, which must cover at least `needed` bytes of the
    /// file; returns the bytes read (more than `needed` when the aligned tail fits).
    /// `dst`, `off` and `dst.len()` are 4 KiB-aligned.
    pub fn read_covering(&self, dst: &mut [u8], off: u64, needed: usize, status: &DirectStatus) -> io::Result<usize> {
        let direct = self.direct.as_ref().filter(|_| self.is_direct());
        let direct_read = direct.map(|f| move |b: &mut [u8], o: u64| f.read_at(b, o));
        read_covering(
            dst,
            off,
            needed,
            direct_read.as_ref().map(|f| f as &dyn Fn(&mut [u8], u64) -> io::Result<usize>),
            &|b, o| self.buffered.read_at(b, o),
            &mut |e| {
                self.direct_on.store(false, Ordering::Relaxed);
                status.fell_back(format!(
                    "{}: O_DIRECT read refused ({e}); reading through the page cache",
                    self.path.display()
                ));
            },
        )
    }
}

type ReadAt<'a> = &'a dyn Fn(&mut [u8], u64) -> io::Result<usize>;

/// The read loop with its fallback, apart from any file so that tests can inject
/// a direct read that fails. A direct read that fails with EINVAL gives direct
/// reads up (through `gave_up`) and the rest is read buffered; a direct read that
/// stops short of a whole block is the end of the file, and the buffered read
/// that follows says whether the needed bytes are there.
pub(crate) fn read_covering(
    dst: &mut [u8],
    off: u64,
    needed: usize,
    direct: Option<ReadAt<'_>>,
    buffered: ReadAt<'_>,
    gave_up: &mut dyn FnMut(&io::Error),
) -> io::Result<usize> {
    let mut got = 0;
    if let Some(read) = direct {
        while got < needed {
            match read(&mut dst[got..], off + got as u64) {
                Ok(0) => break,
                Ok(n) => {
                    got += n;
                    if n % ALIGN != 0 {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    gave_up(&e);
                    break;
                }
                Err(e) => return Err(e),
            }
        }
    }
    while got < needed {
        match buffered(&mut dst[got..], off + got as u64) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "short read: the file ends {got} bytes into a {needed}-byte range at offset {off} (truncated?)"
                    ),
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_reader(data: &[u8]) -> impl Fn(&mut [u8], u64) -> io::Result<usize> + '_ {
        move |b: &mut [u8], o: u64| {
            let o = (o as usize).min(data.len());
            let n = b.len().min(data.len() - o);
            b[..n].copy_from_slice(&data[o..o + n]);
            Ok(n)
        }
    }

    #[test]
    fn einval_on_direct_read_falls_back_to_buffered() {
        let data: Vec<u8> = (0..3 * ALIGN).map(|i| (i * 7 % 251) as u8).collect();
        let refuse = |_: &mut [u8], _: u64| -> io::Result<usize> { Err(io::Error::from_raw_os_error(libc::EINVAL)) };
        let mut gave_up = 0;
        let mut dst = vec![0u8; 2 * ALIGN];
        let n =
            read_covering(&mut dst, ALIGN as u64, 2 * ALIGN, Some(&refuse), &file_reader(&data), &mut |_| gave_up += 1)
                .unwrap();
        assert_eq!(n, 2 * ALIGN);
        assert_eq!(gave_up, 1);
        assert_eq!(dst, data[ALIGN..3 * ALIGN]);
    }

    #[test]
    fn other_direct_errors_are_errors() {
        let data = vec![1u8; ALIGN];
        let eio = |_: &mut [u8], _: u64| -> io::Result<usize> { Err(io::Error::from_raw_os_error(libc::EIO)) };
        let mut dst = vec![0u8; ALIGN];
        let e = read_covering(&mut dst, 0, ALIGN, Some(&eio), &file_reader(&data), &mut |_| panic!("no fallback"))
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
    }

    #[test]
    fn short_read_is_an_error_and_tail_past_eof_is_not() {
        let data = vec![9u8; ALIGN + 100];
        let mut dst = vec![0u8; 2 * ALIGN];
        // The file's last block is partial: reading the aligned range covering the
        // last 100 real bytes succeeds.
        let direct = file_reader(&data);
        let n = read_covering(&mut dst, 0, ALIGN + 100, Some(&direct), &file_reader(&data), &mut |_| {}).unwrap();
        assert_eq!(n, ALIGN + 100);
        // Needing one byte more than the file holds is a short read.
        let e = read_covering(&mut dst, 0, ALIGN + 101, Some(&direct), &file_reader(&data), &mut |_| {}).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(e.to_string().contains("short read"), "{e}");
    }

    #[test]
    fn aligned_buffers_are_aligned_and_zeroed() {
        for len in [1, ALIGN - 1, ALIGN, 3 * ALIGN + 5] {
            let b = AlignedBuf::new(len);
            // SAFETY: no other thread touches `b`.
            let s = unsafe { b.slice(0, len) };
            assert_eq!(s.as_ptr() as usize % ALIGN, 0);
            assert!(s.iter().all(|&x| x == 0));
        }
    }
}
