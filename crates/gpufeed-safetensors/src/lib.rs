//! # gpufeed-safetensors — layer 3 of gpufeed: safetensors checkpoints to GPU memory and back
//!
//! - [`load`] / [`load_with`]: a safetensors file or a sharded checkpoint (its
//!   `*.safetensors.index.json`) into GPU memory, one bulk transfer per file, a named view per
//!   tensor ([`Checkpoint`]); every header is read and checked before a byte moves, with `pread`
//!   on the descriptor that the load then uses, and the file's identity is checked on it again
//!   after the copies. [`load_on`] does it in one call from a device ordinal, the GPU opened on
//!   another thread meanwhile.
//! - [`TensorParallel`] / [`load_shard`]: each rank's share of every tensor (rows, columns or
//!   any dimension), only those bytes read.
//! - [`LoadInto`] / [`load_into`]: a checkpoint's tensors written into device memory the
//!   caller owns (preallocated parameters), through two bounded staging buffers on the device.
//! - [`OnDemand`]: tensors one at a time, each file registered once, each load one copy by the
//!   GPU out of the page cache.
//! - [`Prefetch`]: byte ranges of a file (tensors, rows of tensors) loading in the background
//!   in chunks of their own device memory, each handed out once, as asked or as they land:
//!   what the Python package's drop-in `safe_open` stands on.
//! - [`save`] / [`save_sharded`]: GPU (or host) tensors to a file or to shards and an index,
//!   crash-safe (the old checkpoint or the new one, whole; shards of several saves refused on
//!   load: [`Error::MixedCheckpoint`]).
//! - [`header`] / [`header_of`] / [`inspect`]: the header alone, parsed and checked.
//!
//! Depends on `gpufeed-load` (the loader and the saver), `gpufeed-cuda` and `gpufeed-os`; the
//! `safetensors` crate for its `Dtype` and its format.
//!
//! `gpufeed-multi` builds tensor-parallel and replicated checkpoint loads on it; the `gpufeed`
//! facade re-exports it as `gpufeed::safetensors`.
//!
//! # Example
//! ```no_run
//! let gpu = gpufeed_load::Gpu::open(0)?;
//! let ckpt = gpufeed_safetensors::load(&gpu, "model.safetensors.index.json")?;
//! for name in ckpt.names() {
//!     let (info, view) = ckpt.get(name).expect("a tensor of the checkpoint");
//!     println!("{name}: {:?} {:?}, {} bytes on the GPU", info.dtype, info.shape, view.len());
//! }
//! # Ok::<(), gpufeed_safetensors::Error>(())
//! ```

#![deny(unsafe_code)]

mod checkpoint;
mod error;
mod header;
mod index;
mod into;
#[cfg(feature = "object")]
mod object;
mod on_demand;
mod prefetch;
mod save;
mod source;
mod tensor_parallel;

pub use checkpoint::{
    Checkpoint, Dtype, FileLayout, TensorInfo, inspect, inspect_opened, load, load_on, load_with,
};
pub use error::{Error, Result};
pub use header::{
    HeaderEntry, HeaderError, HeaderParts, MAX_HEADER_BYTES, header, header_and_metadata,
    header_of, parse_is_kept,
};
pub use index::{FILE_SIZES_KEY, SAVE_ID_KEY, is_checkpoint_name};
pub use into::{Delivery, LoadInto, LoadIntoOptions, LoadIntoReport, Share, load_into};
#[cfg(feature = "object")]
pub use object::{inspect_object, inspect_object_opened, load_object, load_objects_opened};
pub use on_demand::OnDemand;
pub use prefetch::{Piece, Prefetch, PrefetchItem, PrefetchOptions};
pub use save::{SaveTensor, save, save_sharded};
pub use source::PrefetchSource;
pub use tensor_parallel::{Split, TensorParallel, TensorShare, load_shard};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::*;
    use crate::index::*;
    use std::path::Path;

    #[test]
    fn hostile_headers_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cases: [(&str, Vec<u8>); 5] = [
            ("short", vec![1, 2, 3]),
            ("huge length", u64::MAX.to_le_bytes().to_vec()),
            (
                "past the end",
                [100u64.to_le_bytes().to_vec(), b"{}".to_vec()].concat(),
            ),
            (
                "not json",
                [4u64.to_le_bytes().to_vec(), b"{{{{".to_vec()].concat(),
            ),
            ("offsets outside", {
                let h = br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,1000]}}"#;
                [
                    (h.len() as u64).to_le_bytes().to_vec(),
                    h.to_vec(),
                    vec![0u8; 16],
                ]
                .concat()
            }),
        ];
        for (what, bytes) in cases {
            let p = dir.path().join(format!("{what}.safetensors"));
            std::fs::write(&p, &bytes).expect("write");
            let err = parse(&p)
                .err()
                .unwrap_or_else(|| panic!("{what}: accepted"));
            assert!(matches!(err, Error::Safetensors { .. }), "{what}: {err:?}");
            // A sentence, not the crate's Debug output.
            let msg = err.to_string();
            for debug in [
                "HeaderTooLarge",
                "HeaderTooSmall",
                "InvalidHeaderLength",
                "MetadataIncompleteBuffer",
                "InvalidOffset(",
                "TensorInvalidInfo",
            ] {
                assert!(!msg.contains(debug), "{what}: {msg}");
            }
            assert!(
                msg.contains(&*p.to_string_lossy()),
                "{what}: names the file: {msg}"
            );
        }
        // Files that are not regular files are refused before any read.
        assert!(matches!(
            parse(Path::new("/proc/self/status")),
            Err(Error::Load(gpufeed_load::Error::Os(
                gpufeed_os::Error::PseudoFile { .. }
            )))
        ));
        assert!(matches!(
            parse(dir.path()),
            Err(Error::Load(gpufeed_load::Error::Os(
                gpufeed_os::Error::IsDirectory { .. }
            )))
        ));
    }

    /// The header is parsed from a prefix and the file's length: what follows the header is
    /// never read, so a file whose data section is missing is refused by length, and the
    /// same bytes with the right length parse.
    #[test]
    fn headers_parse_from_a_prefix_and_the_file_length() {
        let h = br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
        let prefix = [(h.len() as u64).to_le_bytes().to_vec(), h.to_vec()].concat();
        let full_len = prefix.len() as u64 + 16;
        let (start, tensors) = header_of(&prefix, full_len).expect("parse");
        assert_eq!(start, prefix.len() as u64);
        assert_eq!(tensors[0].range, 0..16);
        let err = header_of(&prefix, full_len - 1).unwrap_err();
        assert_eq!(
            err,
            HeaderError::DataSize {
                covered: 16,
                data_len: 15
            }
        );
        assert!(
            err.to_string()
                .contains("cover 16 bytes but the data section has 15"),
            "{err}"
        );
        // A prefix that stops inside the header says how much to read.
        let err = header_of(&prefix[..20], full_len).unwrap_err();
        assert_eq!(
            err,
            HeaderError::Incomplete {
                have: 20,
                need: prefix.len() as u64
            }
        );
        assert!(
            header_of(&prefix[..prefix.len()], full_len).is_ok(),
            "that much is enough"
        );
        assert_eq!(
            header_of(&prefix[..5], full_len).unwrap_err(),
            HeaderError::Incomplete { have: 5, need: 8 }
        );
        assert_eq!(
            header_of(&prefix[..5], 5).unwrap_err(),
            HeaderError::Truncated {
                file_len: 5,
                need: 8
            }
        );
    }

    proptest::proptest! {
        /// Any bytes and any claimed file length: tensors inside the data section, or a
        /// sentence; never a panic (the CI form of the fuzz target).
        #[test]
        fn arbitrary_headers_never_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            extra in 0u64..1000,
        ) {
            let file_len = bytes.len() as u64 + extra;
            if let Ok((start, tensors)) = header_of(&bytes, file_len) {
                for HeaderEntry { range: r, .. } in tensors {
                    proptest::prop_assert!(r.start <= r.end && start + r.end as u64 <= file_len);
                }
            }
        }

        /// Any index text, and weight maps of arbitrary names: shard files inside the index's
        /// directory, or an error; never a panic.
        #[test]
        fn arbitrary_indexes_never_panic(
            text in ".{0,200}",
            names in proptest::collection::vec(("[a-z.]{1,8}", "[a-z./]{0,12}"), 0..6),
        ) {
            let dir = Path::new("/ckpt");
            let index = dir.join("model.safetensors.index.json");
            let map: serde_json::Map<String, serde_json::Value> = names
                .into_iter()
                .map(|(t, f)| (t, serde_json::Value::String(f)))
                .collect();
            let structured = serde_json::json!({ "weight_map": map }).to_string();
            for t in [text.as_str(), structured.as_str()] {
                if let Ok(parsed) = shards_of(t, &index) {
                    proptest::prop_assert!(!parsed.files.is_empty());
                    for (f, _) in parsed.files {
                        proptest::prop_assert_eq!(f.parent(), Some(dir));
                    }
                }
            }
        }

        /// The one-pass parser accepts exactly the headers the `safetensors` crate's `Metadata`
        /// accepts (data sections of the length the tensors cover), with the same tensors;
        /// headers that name a tensor twice, which the crate reads as the last one, it refuses.
        #[test]
        fn the_parser_agrees_with_the_safetensors_crate(
            tensors in proptest::collection::vec(
                ("[ab]{1,3}", 0usize..5, proptest::collection::vec(0usize..4, 0..3), 0u8..8),
                0..7,
            ),
            metadata in proptest::prelude::any::<bool>(),
            bad_metadata in proptest::prelude::any::<bool>(),
        ) {
            let dtypes = ["BOOL", "U8", "F16", "F32", "F64", "F4", "NOPE"];
            let mut at = 0usize;
            let mut fields = Vec::new();
            if metadata {
                fields.push(if bad_metadata {
                    r#""__metadata__":{"k":1}"#.to_owned()
                } else {
                    r#""__metadata__":{"format":"pt"}"#.to_owned()
                });
            }
            for (name, dtype, shape, skew) in &tensors {
                let dtype = dtypes[*dtype % dtypes.len()];
                let bits: usize = shape.iter().product::<usize>()
                    * match dtype { "F16" => 16, "F32" => 32, "F64" => 64, "F4" => 4, _ => 8 };
                // skew 0..=5 tiles exactly; 6 and 7 leave a gap or a short span.
                let len = bits.div_ceil(8) + usize::from(*skew == 7);
                let start = at + usize::from(*skew == 6);
                fields.push(format!(
                    r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{start},{}]}}"#,
                    start + len
                ));
                at = start + len;
            }
            let json = format!("{{{}}}", fields.join(","));
            let prefix = [(json.len() as u64).to_le_bytes().to_vec(), json.clone().into_bytes()].concat();
            let file_len = prefix.len() as u64 + at as u64;
            let ours = header_of(&prefix, file_len);
            let names: std::collections::BTreeSet<&String> = tensors.iter().map(|t| &t.0).collect();
            if names.len() < tensors.len() {
                proptest::prop_assert!(ours.is_err(), "a repeated name was accepted: {}", json);
            } else {
                let theirs = serde_json::from_str::<safetensors::tensor::Metadata>(&json)
                    .ok()
                    .filter(|m| m.data_len() == at);
                match (ours, theirs) {
                    (Ok((_, ours)), Some(m)) => {
                        let mut want: Vec<HeaderEntry> = m
                            .tensors()
                            .into_iter()
                            .map(|(n, i)| HeaderEntry {
                                name: n,
                                dtype: i.dtype,
                                shape: i.shape.clone(),
                                range: i.data_offsets.0..i.data_offsets.1,
                            })
                            .collect();
                        want.sort_by(|x, y| x.name.cmp(&y.name));
                        proptest::prop_assert_eq!(ours, want);
                    }
                    (Err(_), None) => {}
                    (ours, theirs) => proptest::prop_assert!(
                        false, "{}: ours {:?}, the crate's {}", json, ours, theirs.is_some()
                    ),
                }
            }
        }

        /// Valid headers with one byte changed, or a JSON value spliced in.
        #[test]
        fn mutated_headers_never_panic(at in 0usize..80, val in proptest::prelude::any::<u8>(), n in 1usize..6) {
            let json = format!(
                r#"{{"t":{{"dtype":"F16","shape":[{n},2],"data_offsets":[0,{}]}}}}"#,
                n * 4
            );
            let mut bytes = [(json.len() as u64).to_le_bytes().to_vec(), json.into_bytes()].concat();
            let file_len = bytes.len() as u64 + (n as u64) * 4;
            if at < bytes.len() {
                bytes[at] = val;
            }
            let _ = header_of(&bytes, file_len);
        }
    }

    #[test]
    fn headers_written_by_the_crate_parse() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("ok.safetensors");
        let a = vec![1u8; 12];
        let b = vec![2u8; 6];
        let views = [
            (
                "a",
                safetensors::tensor::TensorView::new(Dtype::F32, vec![3], &a).expect("view"),
            ),
            (
                "b",
                safetensors::tensor::TensorView::new(Dtype::I16, vec![3], &b).expect("view"),
            ),
        ];
        safetensors::serialize_to_file(views, None, &p).expect("serialize");
        let parsed = parse(&p).expect("parse");
        assert_eq!(parsed.tensors.len(), 2);
        assert_eq!(parsed.data_len, 18);
        assert_eq!(parsed.tensors[1].name, "b");
        assert_eq!(parsed.tensors[1].shape, vec![3]);
    }

    /// A header opened again is its first parse, shared; a header whose bytes or file length
    /// differ is parsed anew, whatever the file's name.
    #[test]
    fn headers_parsed_once_per_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = |name: &str, tensor: &str, extra: usize| {
            let p = dir.path().join(name);
            let a = vec![7u8; 12 + extra];
            let shape = vec![(12 + extra) / 4];
            let views = [(
                tensor,
                safetensors::tensor::TensorView::new(Dtype::F32, shape, &a).expect("view"),
            )];
            safetensors::serialize_to_file(views, None, &p).expect("serialize");
            p
        };
        let p = file("m.safetensors", "alpha", 0);
        let (first, again) = (parse(&p).expect("parse"), parse(&p).expect("parse"));
        assert!(std::sync::Arc::ptr_eq(&first.tensors, &again.tensors));
        assert!(parse_is_kept(&first.tensors));
        let unkept: std::sync::Arc<[HeaderEntry]> = first.tensors.to_vec().into();
        assert!(
            !parse_is_kept(&unkept),
            "an equal parse of its own is not the kept one"
        );
        // The same bytes under another name: the same parse.
        std::fs::copy(&p, dir.path().join("copy.safetensors")).expect("copy");
        let copy = parse(&dir.path().join("copy.safetensors")).expect("parse");
        assert!(std::sync::Arc::ptr_eq(&first.tensors, &copy.tensors));
        // Rewritten in place: another name of the same length, the file as long as before.
        let q = file("m.safetensors", "gamma", 0);
        assert_eq!(q, p);
        let renamed = parse(&p).expect("parse");
        assert_eq!(renamed.tensors[0].name, "gamma");
        assert!(!std::sync::Arc::ptr_eq(&first.tensors, &renamed.tensors));
        // The first header again, the file 4 bytes longer: its tensors no longer tile it.
        file("m.safetensors", "alpha", 0);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .expect("open");
        std::io::Write::write_all(&mut f, &[0u8; 4]).expect("append");
        drop(f);
        let Err(longer) = parse(&p) else {
            panic!("a file longer than its tensors parsed");
        };
        assert!(
            matches!(
                longer,
                Error::Safetensors {
                    reason: HeaderError::DataSize {
                        covered: 12,
                        data_len: 16
                    },
                    ..
                }
            ),
            "{longer:?}"
        );
    }

    #[test]
    fn bad_indexes() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (what, text) in [
            ("not json", "{"),
            ("no map", "{}"),
            ("escape", r#"{"weight_map":{"a":"../x.safetensors"}}"#),
            ("the directory itself", r#"{"weight_map":{"a":"."}}"#),
            (
                "a subdirectory",
                r#"{"weight_map":{"a":"sub/x.safetensors"}}"#,
            ),
            ("empty", r#"{"weight_map":{}}"#),
            ("number", r#"{"weight_map":{"a":3}}"#),
        ] {
            let p = dir.path().join("model.safetensors.index.json");
            std::fs::write(&p, text).expect("write");
            assert!(matches!(shards(&p), Err(Error::Index { .. })), "{what}");
        }
    }
}
