//! `ImageLoader`: an image folder and WebDataset shards into batches of decoded, cropped,
//! resized, mirrored images — every image equal to the CPU reference of its own crop (drawn
//! from the seed, the epoch and its record's index), labels from class folders and `.cls`
//! members, bad files by policy with their names, the same batches whatever the worker count,
//! an elastic run resumed with another world size; on the GPU, the same records and labels as
//! the CPU path, each image as nvJPEG decodes it alone, whatever the decode threads.

use std::path::Path;

use gpufeed_data::{
    Augmentation, BatchLoaderOptions, Dataset, Error, ImageBatch, ImageData, ImageDecoder,
    ImageError, ImageFolder, ImageLoader, ImageOptions, Layout, OnBadImage, Order, RecordFile,
    Sampler, ShardSet, decode_jpeg, normalize_chw, resize_crop, to_u8,
};

use crate::gpu_or_skip;
use crate::images::{KINDS, jpeg};

/// Output size (width, height): not square, smaller and larger than some images.
const OUT: (u32, u32) = (24, 20);

/// Writes an image folder of three classes under `root`: JPEGs of every kind at odd sizes
/// (`per` per class); returns each sample's (path, label, bytes) in the folder's order.
fn folder(root: &Path, per: usize) -> Vec<(String, u32, Vec<u8>)> {
    let mut out = Vec::new();
    for (label, class) in ["ant", "bee", "cat"].iter().enumerate() {
        std::fs::create_dir_all(root.join(class)).expect("class folder");
        for i in 0..per {
            let k = (label * per + i) % KINDS.len();
            let (w, h) = (17 + 13 * (i as u16 % 5), 9 + 11 * (k as u16 % 4));
            let bytes = jpeg(w, h, KINDS[k]).0;
            let path = root.join(class).join(format!("{i:03}.jpg"));
            std::fs::write(&path, &bytes).expect("write");
            out.push((path.display().to_string(), label as u32, bytes));
        }
    }
    out
}

/// The CPU reference of record `index`'s image in `epoch`: decoded, its crop and mirror drawn,
/// resized to `OUT`, in `layout`.
fn reference(bytes: &[u8], aug: Augmentation, epoch: u64, index: usize, layout: Layout) -> Vec<u8> {
    let image = decode_jpeg(bytes).expect("decodes");
    let (crop, flip) = aug.choose(epoch, index as u64, image.width, image.height);
    let values = resize_crop(
        &image.pixels,
        image.width,
        image.height,
        crop,
        OUT.0,
        OUT.1,
        flip,
    )
    .expect("resize");
    match layout {
        Layout::U8Hwc => to_u8(&values),
        Layout::F32Chw { mean, std } => normalize_chw(&values, OUT.0, OUT.1, mean, std)
            .expect("normalize")
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    }
}

fn options(aug: Augmentation) -> ImageOptions {
    ImageOptions::default()
        .with_size(OUT.1, OUT.0)
        .with_augmentation(aug)
}

fn host(batch: &ImageBatch) -> &[u8] {
    match &batch.data {
        Some(ImageData::Host(p)) => p,
        None => &[],
        Some(ImageData::Device(_)) => panic!("no GPU was given"),
    }
}

/// Every batch of `epoch` as (indices, labels, pixels on the host).
fn run(loader: &mut ImageLoader, epoch: u64) -> Vec<(Vec<usize>, Vec<u32>, Vec<u8>)> {
    loader
        .epoch(epoch)
        .expect("epoch")
        .map(|b| {
            let b = b.expect("batch");
            let pixels = host(&b).to_vec();
            (b.indices, b.labels, pixels)
        })
        .collect()
}

#[test]
fn an_image_folder_gives_batches_equal_to_the_cpu_reference_of_each_crop() {
    let dir = tempfile::tempdir().expect("tempdir");
    let samples = folder(dir.path(), 9);
    let aug = Augmentation::train(3);
    let sampler = Sampler::new(Order::Shuffled { seed: 5 });
    let cfg = BatchLoaderOptions::default().with_batch_size(5);
    let folder = ImageFolder::open(dir.path()).expect("folder");
    let mut loader =
        ImageLoader::new(folder, sampler, cfg.clone(), options(aug), None).expect("loader");
    assert_eq!(loader.cpu_only(), Some("no GPU was given"));
    assert_eq!(loader.batches_per_epoch(), 6);
    for epoch in [0, 1] {
        let batches = run(&mut loader, epoch);
        let order: Vec<usize> = batches.iter().flat_map(|b| b.0.clone()).collect();
        assert_eq!(
            order,
            sampler.epoch(samples.len(), epoch),
            "the sampler's order"
        );
        for (indices, labels, pixels) in &batches {
            let want: Vec<u8> = indices
                .iter()
                .flat_map(|&i| reference(&samples[i].2, aug, epoch, i, Layout::U8Hwc))
                .collect();
            assert_eq!(pixels, &want, "epoch {epoch} batch {indices:?}");
            let want_labels: Vec<u32> = indices.iter().map(|&i| samples[i].1).collect();
            assert_eq!(labels, &want_labels);
        }
    }
    // Another epoch draws other crops: the pixels of some record differ.
    let (a, b) = (run(&mut loader, 0), run(&mut loader, 1));
    assert!(!a.is_empty());
    assert_ne!(
        a.iter().map(|x| &x.2).collect::<Vec<_>>(),
        b.iter().map(|x| &x.2).collect::<Vec<_>>()
    );

    // Normalized f32 CHW, evaluation crops; more workers give the same batches.
    let mean = [0.485, 0.456, 0.406];
    let std = [0.229, 0.224, 0.225];
    let layout = Layout::F32Chw { mean, std };
    let eval = Augmentation::Eval {
        crop_fraction: 0.875,
    };
    let mut batches = Vec::new();
    // Reading workers and CPU decode threads (each on its share of the cores) in two counts.
    for (workers, decoders) in [(1, 1), (4, 3)] {
        let folder = ImageFolder::open(dir.path()).expect("folder");
        let mut loader = ImageLoader::new(
            folder,
            sampler,
            cfg.clone().with_workers(workers).with_prefetch(3),
            options(eval).with_layout(layout).with_decoders(decoders),
            None,
        )
        .expect("loader");
        batches.push(run(&mut loader, 2));
    }
    assert_eq!(
        batches[0], batches[1],
        "1 worker and decoder, 4 workers and 3 decoders"
    );
    for (indices, _, pixels) in &batches[0] {
        let want: Vec<u8> = indices
            .iter()
            .flat_map(|&i| reference(&samples[i].2, eval, 2, i, layout))
            .collect();
        assert_eq!(pixels, &want);
    }
}

/// A WebDataset sample: its key and members (extension, bytes).
type Sample<'a> = (String, Vec<(&'a str, Vec<u8>)>);

/// A WebDataset tar of `samples`.
fn tar(path: &Path, samples: &[Sample<'_>]) {
    let mut tar = tar::Builder::new(Vec::new());
    for (key, members) in samples {
        for (ext, data) in members {
            let mut h = tar::Header::new_ustar();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            tar.append_data(&mut h, format!("{key}.{ext}"), data.as_slice())
                .expect("append");
        }
    }
    std::fs::write(path, tar.into_inner().expect("tar")).expect("write");
}

#[test]
fn webdataset_shards_give_each_samples_jpeg_and_its_cls_label() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut all = Vec::new();
    let mut paths = Vec::new();
    for shard in 0..2 {
        let mut samples = Vec::new();
        for s in 0..7 {
            let k = (shard * 7 + s) % KINDS.len();
            let bytes = jpeg(20 + 7 * s as u16, 31 - 2 * s as u16, KINDS[k]).0;
            let label = (shard * 7 + s) as u32 % 5 + 10;
            // Members in either order, an extra one in some.
            let mut members = vec![
                ("cls", format!("{label}\n").into_bytes()),
                ("jpg", bytes.clone()),
            ];
            if s % 2 == 0 {
                members.reverse();
                members.push(("json", b"{}".to_vec()));
            }
            samples.push((format!("train/{shard}-{s:04}"), members));
            all.push((label, bytes));
        }
        let path = dir.path().join(format!("shard-{shard}.tar"));
        tar(&path, &samples);
        paths.push(path);
    }
    let open = |paths: &[std::path::PathBuf]| -> Dataset {
        let files = paths
            .iter()
            // SAFETY: the test's files are not changed while they are mapped.
            .map(|p| unsafe { RecordFile::open_tar(p) }.expect("tar"))
            .collect();
        Dataset::Shards(ShardSet::new(files))
    };
    let aug = Augmentation::train(9);
    let cfg = BatchLoaderOptions::default().with_batch_size(4);
    let sampler = Sampler::new(Order::Shuffled { seed: 2 });
    let mut loader =
        ImageLoader::new(open(&paths), sampler, cfg.clone(), options(aug), None).expect("loader");
    let mut seen = Vec::new();
    for (indices, labels, pixels) in run(&mut loader, 0) {
        let want: Vec<u8> = indices
            .iter()
            .flat_map(|&i| reference(&all[i].1, aug, 0, i, Layout::U8Hwc))
            .collect();
        assert_eq!(pixels, want);
        assert_eq!(
            labels,
            indices.iter().map(|&i| all[i].0).collect::<Vec<_>>()
        );
        seen.extend(indices);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..14).collect::<Vec<_>>());

    // A sample without an image, one with a label that is no number: an error naming the
    // shard and the key, or left out and listed.
    let bad = dir.path().join("bad.tar");
    let good = jpeg(16, 16, KINDS[0]).0;
    tar(
        &bad,
        &[
            (
                "a".into(),
                vec![("jpg", good.clone()), ("cls", b"1".to_vec())],
            ),
            (
                "b".into(),
                vec![("png", b"\x89PNG".to_vec()), ("cls", b"2".to_vec())],
            ),
            (
                "c".into(),
                vec![("jpg", good.clone()), ("cls", b"dog".to_vec())],
            ),
            ("d".into(), vec![("jpg", good.clone())]),
        ],
    );
    let seq = || Sampler::new(Order::Sequential);
    let mut strict = ImageLoader::new(
        open(std::slice::from_ref(&bad)),
        seq(),
        cfg.clone(),
        options(aug),
        None,
    )
    .expect("loader");
    let err = strict
        .epoch(0)
        .expect("epoch")
        .next()
        .expect("a batch")
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("bad.tar:b")
            && text.contains("no .jpg or .jpeg member")
            && text.contains(".png"),
        "{text}"
    );
    let mut lenient = ImageLoader::new(
        open(&[bad]),
        seq(),
        cfg,
        options(aug).with_on_bad(OnBadImage::Skip),
        None,
    )
    .expect("loader");
    let batch = lenient
        .epoch(0)
        .expect("epoch")
        .next()
        .expect("a batch")
        .expect("skips");
    assert_eq!(batch.indices, vec![0, 3]);
    assert_eq!(batch.labels, vec![1, u32::MAX], "no .cls: no label");
    let names: Vec<&str> = batch.skipped.iter().map(|s| s.name.as_str()).collect();
    assert!(
        names[0].ends_with("bad.tar:b") && names[1].ends_with("bad.tar:c"),
        "{names:?}"
    );
    assert!(batch.skipped[1].reason.to_string().contains("\"dog\""));
    assert_eq!(host(&batch).len(), 2 * 3 * (OUT.0 * OUT.1) as usize);

    // Keys with dots (`img.001.jpg`, `img.001.cls`: key `img`, extensions `001.jpg` and
    // `001.cls`, as webdataset splits them): the image and the label both by their last
    // suffix (before: the image was found and the label silently left out).
    let dotted = dir.path().join("dotted.tar");
    tar(
        &dotted,
        &[(
            "img".into(),
            vec![("001.jpg", good.clone()), ("001.cls", b"4".to_vec())],
        )],
    );
    let mut loader = ImageLoader::new(
        open(&[dotted]),
        seq(),
        BatchLoaderOptions::default().with_batch_size(1),
        options(aug),
        None,
    )
    .expect("loader");
    let batch = loader
        .epoch(0)
        .expect("epoch")
        .next()
        .expect("a batch")
        .expect("decodes");
    assert_eq!(batch.labels, vec![4], "the label of a dotted key");
}

#[test]
fn bad_files_in_a_folder_are_an_error_naming_them_or_skipped_and_listed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let samples = folder(dir.path(), 4);
    let truncated = &samples[5].2[..samples[5].2.len() / 2];
    std::fs::write(&samples[5].0, truncated).expect("truncate");
    std::fs::write(&samples[9].0, b"\x89PNG\r\n\x1a\n....").expect("png");
    let cfg = BatchLoaderOptions::default().with_batch_size(6);
    let seq = || Sampler::new(Order::Sequential);
    let aug = Augmentation::train(1);
    let open = || ImageFolder::open(dir.path()).expect("folder");
    let mut strict =
        ImageLoader::new(open(), seq(), cfg.clone(), options(aug), None).expect("loader");
    let mut epoch = strict.epoch(0).expect("epoch");
    match epoch.next().expect("batch 0") {
        Err(Error::Image {
            name,
            reason: ImageError::Truncated { .. },
        }) => assert_eq!(name, samples[5].0),
        other => panic!("batch 0 holds the truncated file: {other:?}"),
    }
    // The epoch goes on after a bad batch.
    match epoch.next().expect("batch 1") {
        Err(Error::Image { name, reason }) => {
            assert_eq!(name, samples[9].0);
            assert!(reason.to_string().contains("PNG"), "{reason}");
        }
        other => panic!("batch 1 holds the PNG: {other:?}"),
    }
    drop(epoch);
    let mut lenient = ImageLoader::new(
        open(),
        seq(),
        cfg,
        options(aug).with_on_bad(OnBadImage::Skip),
        None,
    )
    .expect("loader");
    let batches: Vec<ImageBatch> = lenient
        .epoch(0)
        .expect("epoch")
        .collect::<Result<_, _>>()
        .expect("skips");
    let kept: Vec<usize> = batches.iter().flat_map(|b| b.indices.clone()).collect();
    let want: Vec<usize> = (0..12).filter(|i| ![5, 9].contains(i)).collect();
    assert_eq!(kept, want);
    let skipped: Vec<&str> = batches
        .iter()
        .flat_map(|b| b.skipped.iter().map(|s| s.name.as_str()))
        .collect();
    assert_eq!(skipped, [samples[5].0.as_str(), samples[9].0.as_str()]);
    for b in &batches {
        let want: Vec<u8> = b
            .indices
            .iter()
            .flat_map(|&i| reference(&samples[i].2, aug, 0, i, Layout::U8Hwc))
            .collect();
        assert_eq!(host(b), want.as_slice());
    }
    // Settings that cannot work are refused when the loader is made.
    for opts in [
        options(aug).with_size(0, 10),
        options(aug).with_layout(Layout::F32Chw {
            mean: [0.0; 3],
            std: [1.0, 0.0, 1.0],
        }),
        options(Augmentation::Train {
            seed: 0,
            scale: (0.5, 0.1),
            ratio: (0.75, 1.33),
        }),
        options(Augmentation::Eval { crop_fraction: 0.0 }),
    ] {
        let err = ImageLoader::new(open(), seq(), BatchLoaderOptions::default(), opts, None)
            .expect_err("refused");
        assert!(err.to_string().contains("invalid setting"), "{err}");
    }
}

#[test]
fn an_elastic_run_resumed_with_another_world_size_sees_the_rest_cropped_the_same() {
    let dir = tempfile::tempdir().expect("tempdir");
    let samples = folder(dir.path(), 10); // 30 records, global batches of 6: 5 steps
    let aug = Augmentation::train(4);
    let order = Order::Shuffled { seed: 8 };
    let open = |rank: usize, world: usize| {
        let sampler = Sampler::elastic(order, 6, rank, world, true).expect("elastic");
        ImageLoader::new(
            ImageFolder::open(dir.path()).expect("folder"),
            sampler,
            BatchLoaderOptions::default(),
            options(aug),
            None,
        )
        .expect("loader")
    };
    // A world of two runs two steps.
    let mut seen = Vec::new();
    let mut position = None;
    for rank in 0..2 {
        let mut loader = open(rank, 2);
        let mut epoch = loader.epoch(1).expect("epoch");
        for _ in 0..2 {
            let b = epoch.next().expect("a step").expect("batch");
            assert_eq!(b.len(), 3);
            seen.push(b);
        }
        position = epoch.position();
    }
    let position = position.expect("elastic");
    assert_eq!((position.epoch, position.samples), (1, 12));
    // A world of three goes on from there.
    for rank in 0..3 {
        let mut loader = open(rank, 3);
        let rest: Vec<ImageBatch> = loader
            .resume(&position)
            .expect("resume")
            .collect::<Result<_, _>>()
            .expect("batches");
        assert_eq!(rest.len(), 3, "steps 2, 3, 4");
        assert_eq!(rest[0].number, 2);
        seen.extend(rest);
    }
    let mut records: Vec<usize> = seen.iter().flat_map(|b| b.indices.clone()).collect();
    records.sort_unstable();
    assert_eq!(records, (0..30).collect::<Vec<_>>(), "each record once");
    for b in &seen {
        let want: Vec<u8> = b
            .indices
            .iter()
            .flat_map(|&i| reference(&samples[i].2, aug, 1, i, Layout::U8Hwc))
            .collect();
        assert_eq!(host(b), want.as_slice(), "epoch 1's crop of each record");
    }
    // Dropping an epoch mid-way gives the loader back for the next.
    let mut loader = open(0, 1);
    let mut epoch = loader.epoch(0).expect("epoch");
    epoch.next().expect("one").expect("batch");
    drop(epoch);
    assert_eq!(loader.epoch(0).expect("again").count(), 5);
    let owned = loader.into_epoch(0, None).map_err(|e| e.0).expect("owned");
    let mut loader = owned.into_loader();
    assert_eq!(loader.epoch(3).expect("after").count(), 5);
}

#[test]
fn on_the_gpu_batches_hold_what_nvjpeg_decodes_alone_whatever_the_decode_threads() {
    let Some(gpu) = gpu_or_skip(
        "on_the_gpu_batches_hold_what_nvjpeg_decodes_alone_whatever_the_decode_threads",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let samples = folder(dir.path(), 12);
    let aug = Augmentation::train(6);
    let sampler = Sampler::new(Order::Shuffled { seed: 1 });
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(7)
        .with_workers(3);
    let mut runs = Vec::new();
    for decoders in [1, 3] {
        let mut loader = ImageLoader::new(
            ImageFolder::open(dir.path()).expect("folder"),
            sampler,
            cfg.clone(),
            options(aug).with_decoders(decoders),
            Some(&gpu),
        )
        .expect("loader");
        if std::env::var_os("GPUFEED_REQUIRE_GPU").is_some() {
            assert_eq!(loader.cpu_only(), None, "nvJPEG loads on the GPU machine");
        }
        let mut batches = Vec::new();
        for b in loader.epoch(0).expect("epoch") {
            let b = b.expect("batch");
            let Some(ImageData::Device(buf)) = &b.data else {
                panic!("a device batch");
            };
            batches.push((
                b.indices.clone(),
                b.labels.clone(),
                gpu.to_vec(buf).expect("download"),
            ));
        }
        runs.push(batches);
    }
    assert_eq!(runs[0], runs[1], "1 and 3 decode threads");
    let mut cpu = ImageLoader::new(
        ImageFolder::open(dir.path()).expect("folder"),
        sampler,
        cfg,
        options(aug),
        None,
    )
    .expect("loader");
    let on_cpu = run(&mut cpu, 0);
    let mut decoder = ImageDecoder::open(&gpu).expect("decoder");
    for ((indices, labels, pixels), (cpu_indices, cpu_labels, cpu_pixels)) in
        runs[0].iter().zip(&on_cpu)
    {
        assert_eq!((indices, labels), (cpu_indices, cpu_labels));
        // Each image as the decoder gives it alone, with its crop.
        let image = OUT.0 as usize * OUT.1 as usize * 3;
        for (k, &i) in indices.iter().enumerate() {
            let mut choose = |_: usize, w: u32, h: u32| aug.choose(0, i as u64, w, h);
            let alone = decoder
                .decode_augmented(
                    &[&samples[i].2],
                    &|_| samples[i].0.clone(),
                    OnBadImage::Error,
                    &mut choose,
                    OUT.0,
                    OUT.1,
                    Layout::U8Hwc,
                )
                .expect("alone");
            let buf = alone.buffer.expect("an image");
            assert_eq!(
                &pixels[k * image..(k + 1) * image],
                gpu.to_vec(&buf).expect("download").as_slice(),
                "record {i}"
            );
        }
        // nvJPEG's IDCT is not zune-jpeg's: close, not equal.
        let psnr = crate::images::psnr(pixels, cpu_pixels);
        assert!(psnr >= 30.0, "{psnr:.1} dB against the CPU path");
    }
}
