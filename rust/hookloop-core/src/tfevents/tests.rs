//! The TensorBoard format's tests: exact bytes, read back through the messages.

use super::encode::*;
use super::file::*;
use super::image::*;
use super::proto::*;
use super::tfrecord::*;
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, Cursor, Write};
use std::path::PathBuf;

use prost::Message;

use crate::error::{Error, ImageError};
use crate::record::{HistogramPoint, ImagePoint, ScalarPoint};
use crate::writer::{FsyncPolicy, Payload};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Splits framed bytes into record payloads, checking both CRCs of every record.
fn read_records(mut bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut records = Vec::new();
    while !bytes.is_empty() {
        assert!(bytes.len() >= 16, "truncated record header");
        let len_bytes: [u8; 8] = bytes[..8].try_into().unwrap();
        let len_crc = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
        assert_eq!(len_crc, masked_crc32c(&len_bytes), "length CRC");
        let len = usize::try_from(u64::from_le_bytes(len_bytes)).unwrap();
        assert!(bytes.len() >= 16 + len, "truncated record data");
        let data = &bytes[12..12 + len];
        let data_crc = u32::from_le_bytes(bytes[12 + len..16 + len].try_into().unwrap());
        assert_eq!(data_crc, masked_crc32c(data), "data CRC");
        records.push(data.to_vec());
        bytes = &bytes[16 + len..];
    }
    records
}

fn decode_events(bytes: &[u8]) -> Vec<Event> {
    read_records(bytes)
        .iter()
        .map(|r| Event::decode(r.as_slice()).unwrap())
        .collect()
}

/// The single summary value of an event.
fn only_value(event: &Event) -> &summary::Value {
    match &event.what {
        Some(event::What::Summary(s)) => {
            assert_eq!(s.value.len(), 1);
            &s.value[0]
        }
        other => panic!("expected a summary, got {other:?}"),
    }
}

fn decode_png(bytes: &[u8]) -> (png::OutputInfo, Vec<u8>) {
    let decoder = png::Decoder::new(BufReader::new(Cursor::new(bytes)));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    (info, buf)
}

fn gradient(width: u32, height: u32, channels: u8) -> Vec<u8> {
    let n = width as usize * height as usize * channels as usize;
    (0..n).map(|i| (i * 7 % 256) as u8).collect()
}

/// A fresh directory under the system temp dir, unique per test and process.
fn scratch_dir(name: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "hookloop-tfevents-{}-{}-{}",
        std::process::id(),
        name,
        n
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn crc32c_test_vectors() {
    // RFC 3720 (iSCSI) B.4 vectors and the common check value.
    assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8A91_36AA);
    assert_eq!(crc32c::crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
    let ascending: Vec<u8> = (0..32).collect();
    assert_eq!(crc32c::crc32c(&ascending), 0x46DD_794E);
}

#[test]
fn masked_crc_of_known_values() {
    // Computed independently (bitwise CRC32C in Python, then the TFRecord mask).
    assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    assert_eq!(masked_crc32c(b""), 0xA282_EAD8);
}

#[test]
fn framed_record_exact_bytes() {
    let mut out = vec![0xEE]; // appending must keep what is already there
    append_record(&mut out, b"abc");
    let expected: [u8; 20] = [
        0xEE, // pre-existing byte
        0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // length 3, u64 LE
        0xb0, 0x99, 0x49, 0x0e, // masked crc of the length bytes
        0x61, 0x62, 0x63, // "abc"
        0x6e, 0x57, 0xf1, 0x21, // masked crc of "abc"
    ];
    assert_eq!(out, expected);
}

#[test]
fn file_version_event_exact_bytes() {
    let records = read_records(&file_version_record(1.5));
    assert_eq!(records.len(), 1);
    let mut expected = vec![0x09]; // field 1, fixed64
    expected.extend_from_slice(&1.5f64.to_le_bytes());
    // step 0 is the proto3 default and is omitted
    expected.extend_from_slice(&[0x1a, 13]); // field 3, length-delimited
    expected.extend_from_slice(b"brain.Event:2");
    assert_eq!(records[0], expected);
}

#[test]
fn scalar_event_exact_bytes() {
    let mut out = Vec::new();
    let scalar = ScalarPoint {
        tag: "a".into(),
        value: 2.0,
        step: 7,
    };
    encode_events(&mut out, 1.5, &[scalar], &[], &[], &[]).unwrap();
    let mut expected = vec![0x09];
    expected.extend_from_slice(&1.5f64.to_le_bytes());
    expected.extend_from_slice(&[
        0x10, 0x07, // field 2 (step), varint 7
        0x2a, 10, // field 5 (summary), 10 bytes
        0x0a, 8, // Summary field 1 (value), 8 bytes
        0x0a, 1, b'a', // Value field 1 (tag) "a"
        0x15, 0x00, 0x00, 0x00, 0x40, // Value field 2 (simple_value), f32 2.0
    ]);
    assert_eq!(read_records(&out), vec![expected]);
}

#[test]
fn image_and_histogram_field_numbers() {
    let image = summary::Value {
        tag: String::new(),
        metadata: None,
        value: Some(summary::value::Value::Image(summary::Image {
            height: 1,
            width: 2,
            colorspace: 3,
            encoded_image_string: vec![0xAB],
        })),
    };
    assert_eq!(
        image.encode_to_vec(),
        [0x22, 9, 0x08, 1, 0x10, 2, 0x18, 3, 0x22, 1, 0xAB]
    );
    let histo = HistogramProto {
        min: 0.0,
        max: 0.0,
        num: 0.0,
        sum: 0.0,
        sum_squares: 0.0,
        bucket_limit: vec![1.0],
        bucket: vec![2.0],
    };
    let mut expected = vec![0x32, 8]; // field 6, packed
    expected.extend_from_slice(&1.0f64.to_le_bytes());
    expected.extend_from_slice(&[0x3a, 8]); // field 7, packed
    expected.extend_from_slice(&2.0f64.to_le_bytes());
    assert_eq!(histo.encode_to_vec(), expected);
    let value = summary::Value {
        tag: String::new(),
        metadata: None,
        value: Some(summary::value::Value::Histo(histo)),
    };
    assert_eq!(value.encode_to_vec()[..2], [0x2a, 20]); // Value field 5
}

#[test]
fn encode_events_round_trip() {
    let scalars = vec![
        ScalarPoint {
            tag: "total_loss".into(),
            value: 0.125,
            step: 19,
        },
        ScalarPoint {
            tag: "lr".into(),
            value: 0.1,
            step: 19,
        },
    ];
    let images = vec![ImagePoint {
        tag: "vis".into(),
        step: 20,
        height: 3,
        width: 5,
        channels: 3,
        pixels: gradient(5, 3, 3),
    }];
    let histograms = vec![HistogramPoint {
        tag: "weights".into(),
        step: 21,
        min: -1.0,
        max: 2.0,
        num: 4.0,
        sum: 3.0,
        sum_squares: 7.0,
        bucket_limits: vec![0.0, 1.0, 2.0],
        bucket_counts: vec![1.0, 2.0, 1.0],
    }];
    let mut out = Vec::new();
    encode_events(&mut out, 1234.5, &scalars, &images, &histograms, &[]).unwrap();
    let events = decode_events(&out);
    assert_eq!(events.len(), 4);
    assert!(events.iter().all(|e| e.wall_time == 1234.5));

    for (event, scalar) in events[..2].iter().zip(&scalars) {
        assert_eq!(event.step, scalar.step);
        let value = only_value(event);
        assert_eq!(value.tag, &*scalar.tag);
        assert_eq!(
            value.value,
            Some(summary::value::Value::SimpleValue(scalar.value as f32))
        );
    }

    assert_eq!(events[2].step, 20);
    let value = only_value(&events[2]);
    assert_eq!(value.tag, "vis");
    let Some(summary::value::Value::Image(image)) = &value.value else {
        panic!("expected an image, got {:?}", value.value);
    };
    assert_eq!((image.height, image.width, image.colorspace), (3, 5, 3));
    let (info, pixels) = decode_png(&image.encoded_image_string);
    assert_eq!((info.width, info.height), (5, 3));
    assert_eq!(pixels, images[0].pixels);

    assert_eq!(events[3].step, 21);
    let value = only_value(&events[3]);
    assert_eq!(value.tag, "weights");
    let Some(summary::value::Value::Histo(h)) = &value.value else {
        panic!("expected a histogram, got {:?}", value.value);
    };
    let hp = &histograms[0];
    assert_eq!(
        (h.min, h.max, h.num, h.sum, h.sum_squares),
        (hp.min, hp.max, hp.num, hp.sum, hp.sum_squares)
    );
    assert_eq!(h.bucket_limit, hp.bucket_limits);
    assert_eq!(h.bucket, hp.bucket_counts);
}

#[test]
fn png_round_trip_grey_rgb_rgba() {
    for (channels, color) in [
        (1, png::ColorType::Grayscale),
        (3, png::ColorType::Rgb),
        (4, png::ColorType::Rgba),
    ] {
        let pixels = gradient(7, 4, channels);
        let bytes = encode_png(7, 4, channels, &pixels).unwrap();
        let (info, decoded) = decode_png(&bytes);
        assert_eq!((info.width, info.height), (7, 4));
        assert_eq!(info.color_type, color);
        assert_eq!(info.bit_depth, png::BitDepth::Eight);
        assert_eq!(decoded, pixels, "{channels} channels");
    }
}

#[test]
fn bad_image_shapes_are_errors() {
    assert!(matches!(
        encode_png(2, 2, 5, &[0; 20]),
        Err(ImageError::UnsupportedChannels { channels: 5 })
    ));
    assert!(matches!(
        encode_png(0, 2, 3, &[]),
        Err(ImageError::Empty {
            width: 0,
            height: 2
        })
    ));
    assert!(matches!(
        encode_png(2, 0, 1, &[]),
        Err(ImageError::Empty { .. })
    ));
    assert!(matches!(
        encode_png(2, 2, 3, &[0; 11]),
        Err(ImageError::PixelCountMismatch { len: 11, .. })
    ));
    assert!(matches!(
        encode_png(u32::MAX, 1, 1, &[0]),
        Err(ImageError::TooLarge { .. })
    ));
    let msg = encode_png(2, 2, 3, &[0; 11]).unwrap_err().to_string();
    assert!(
        msg.contains("2x2x3") && msg.contains("12") && msg.contains("11"),
        "{msg}"
    );
}

#[test]
fn bad_image_leaves_batch_untouched() {
    let mut out = vec![1, 2, 3];
    let scalar = ScalarPoint {
        tag: "loss".into(),
        value: 1.0,
        step: 5,
    };
    let image = ImagePoint {
        tag: "vis".into(),
        step: 5,
        height: 2,
        width: 2,
        channels: 3,
        pixels: vec![0; 5],
    };
    let err = encode_events(&mut out, 0.0, &[scalar], &[image], &[], &[]).unwrap_err();
    assert_eq!(out, [1, 2, 3]);
    let Error::Image { tag, step, source } = &err else {
        panic!("expected an Image error, got {err:?}");
    };
    assert_eq!((tag.as_str(), *step), ("vis", Some(5)));
    assert!(matches!(*source, ImageError::PixelCountMismatch { .. }));
    assert!(err.to_string().starts_with("image 'vis' at iter 5: "));
}

#[test]
fn error_can_cross_threads() {
    // The background writer thread hands errors back to the training thread.
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Error>();
}

#[test]
fn event_file_name_matches_torch() {
    assert_eq!(
        event_file_name(1_700_000_000, "node7", 4242, 0),
        "events.out.tfevents.1700000000.node7.4242.0"
    );
    assert_eq!(
        event_file_name(42, "h", 1, 3),
        "events.out.tfevents.0000000042.h.1.3"
    );
}

#[test]
fn event_file_is_created_lazily() {
    let dir = scratch_dir("lazy").join("nested");
    let mut file = EventFile::new(dir.clone(), "events.out.tfevents.test".into());
    assert_eq!(file.path(), dir.join("events.out.tfevents.test"));
    assert!(!file.is_created());
    assert!(!dir.exists());

    file.append(&[]).unwrap();
    file.flush(true).unwrap();
    assert!(!file.is_created());
    assert!(!dir.exists());

    let mut records = Vec::new();
    let scalar = ScalarPoint {
        tag: "loss".into(),
        value: 0.5,
        step: 3,
    };
    encode_events(&mut records, 10.0, &[scalar], &[], &[], &[]).unwrap();
    file.append(&records).unwrap();
    file.append(&records).unwrap();
    file.flush(true).unwrap();
    assert!(file.is_created());

    let events = decode_events(&std::fs::read(file.path()).unwrap());
    assert_eq!(events.len(), 3);
    assert_eq!(events[0].step, 0);
    assert!(events[0].wall_time > 0.0);
    assert_eq!(
        events[0].what,
        Some(event::What::FileVersion("brain.Event:2".into()))
    );
    assert_eq!(only_value(&events[1]).tag, "loss");
    assert_eq!(events[2].step, 3);

    // create_new: a second writer must not clobber the file.
    let mut other = EventFile::new(dir.clone(), "events.out.tfevents.test".into());
    assert!(other.append(&records).is_err());
    assert!(!other.is_created());

    std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
}

/// A file that accepts `room` more bytes, then fails like a full disk.
struct FullAfter {
    inner: File,
    room: usize,
}

impl crate::append::AppendFile for FullAfter {
    fn write_once(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.room == 0 {
            return Err(io::Error::other("no space left on device (test)"));
        }
        let n = buf.len().min(self.room);
        self.room -= n;
        self.inner.write(&buf[..n])
    }
    fn position(&mut self) -> io::Result<u64> {
        self.inner.position()
    }
    fn real_len(&self) -> io::Result<u64> {
        self.inner.real_len()
    }
    fn truncate_to(&self, len: u64) -> io::Result<()> {
        self.inner.truncate_to(len)
    }
}

#[test]
fn failed_write_is_truncated_away() {
    use crate::append::{append_units, record_ends, AppendFile};
    let dir = scratch_dir("rollback");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("events");
    let file = OpenOptions::new()
        .append(true)
        .create_new(true)
        .open(&path)
        .unwrap();
    let first = file_version_record(1.0);
    let mut second = Vec::new();
    append_record(&mut second, &[7; 100]);
    // Room for the first record and part of the second: a torn write.
    let mut sink = FullAfter {
        inner: file,
        room: first.len() + 30,
    };
    let append = |sink: &mut FullAfter, data: &[u8]| {
        let start = sink.real_len().unwrap();
        append_units(sink, data, &record_ends(data), start)
    };

    append(&mut sink, &first).unwrap();
    let err = append(&mut sink, &second).unwrap_err();
    assert!(err.source.to_string().contains("no space left"), "{err:?}");
    assert_eq!(std::fs::read(&path).unwrap(), first);

    // Append mode: once space frees up, the next record lands right after the last
    // whole one, with no gap where the torn bytes were.
    sink.room = usize::MAX;
    append(&mut sink, &second).unwrap();
    let mut expected = first.clone();
    expected.extend_from_slice(&second);
    assert_eq!(std::fs::read(&path).unwrap(), expected);
    assert_eq!(read_records(&expected).len(), 2);

    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dev_full_returns_the_write_error() {
    // /dev/full cannot be truncated; the write error (ENOSPC) must still come back.
    let path = std::path::Path::new("/dev/full");
    let Ok(mut full) = OpenOptions::new().append(true).open(path) else {
        return; // not on this platform
    };
    let err = append_records(&mut full, path, &file_version_record(1.0)).unwrap_err();
    assert!(
        matches!(&err, Error::Io { source, .. } if source.raw_os_error() == Some(28)),
        "{err}"
    ); // ENOSPC
}

#[test]
fn event_sink_is_lazy() {
    let _serial = crate::writer::test_serial();
    let dir = scratch_dir("events-lazy").join("tb");
    let sink = EventSink::new(dir.clone(), "host", "", FsyncPolicy::Close);
    let path = sink.path();
    let mut h = crate::writer::SinkHandle::open(Box::new(sink), "TensorboardXWriter", path.clone())
        .unwrap();
    h.flush().unwrap();
    assert!(!dir.exists());
    let scalars = vec![ScalarPoint {
        tag: "loss".into(),
        value: 0.5,
        step: 3,
    }];
    h.send(Payload::Events {
        wall_time: 1.0,
        scalars,
        images: vec![],
        histograms: vec![],
        tensors: vec![],
    })
    .unwrap();
    h.close().unwrap();
    assert!(path.exists());
    assert!(path
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("events.out.tfevents."));
}
