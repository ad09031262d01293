//! Text documents users have — JSON Lines and Parquet (what `datasets`'
//! `to_json(lines=True)` and `to_parquet` write) — tokenized with a Hugging
//! Face `tokenizer.json` into a token cache that [`super::Tokens`] reads:
//! each document's ids followed by the tokenizer's end-of-sequence id, all
//! documents packed end to end.
//!
//! The cache lies beside the data (`.hearth-cache/<key>.npy`, uint32), its
//! key the sha256 of the data files, the tokenizer and the settings, so a
//! second run, and every process of a run, reads it instead of tokenizing
//! again. It is written whole or not at all (a temporary file renamed).

use super::DataError;
use sha2::{Digest, Sha256};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// The format of the documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocumentFormat {
    /// One JSON object per line.
    Jsonl,
    /// Parquet files with a string column.
    Parquet,
}

/// What to tokenize and how.
#[derive(Debug, Clone)]
pub struct DocumentsSpec {
    /// The data files, in order (a glob already expanded).
    pub files: Vec<PathBuf>,
    /// Their format.
    pub format: DocumentFormat,
    /// The field (JSONL) or column (Parquet) holding the text.
    pub text_field: String,
    /// The `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// The end-of-sequence token put after each document; `None` finds it
    /// in `tokenizer_config.json` beside the tokenizer, or a well-known one.
    pub eos_token: Option<String>,
}

/// Documents tokenized per call of the tokenizer (each call runs on
/// every core).
const CHUNK: usize = 4096;

/// Version of the cache's contents: bumped when hearth tokenizes
/// differently, so old caches are not reused.
const CACHE_FORMAT: &str = "hearth-token-cache-1";

/// The expanded files of `pattern` (a path or a glob), sorted; an error
/// naming the pattern when none matches.
pub fn expand(pattern: &Path) -> Result<Vec<PathBuf>, DataError> {
    let bad = |message: String| DataError::Format {
        path: pattern.into(),
        message,
    };
    let text = pattern.to_string_lossy();
    if !text.contains(['*', '?', '[']) {
        if !pattern.is_file() {
            return Err(bad("does not exist".into()));
        }
        return Ok(vec![pattern.into()]);
    }
    let mut files: Vec<PathBuf> = glob::glob(&text)
        .map_err(|e| bad(format!("is not a valid glob: {e}")))?
        .filter_map(Result::ok)
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(bad("matches no file".into()));
    }
    Ok(files)
}

/// The tokenizer and its end-of-sequence id.
pub struct LoadedTokenizer {
    tokenizer: Tokenizer,
    eos: u32,
    path: PathBuf,
}

impl LoadedTokenizer {
    /// Reads `spec`'s tokenizer and finds its end-of-sequence token.
    pub fn open(spec: &DocumentsSpec) -> Result<Self, DataError> {
        let path = &spec.tokenizer;
        let bad = |message: String| DataError::Format {
            path: path.clone(),
            message,
        };
        if !path.is_file() {
            return Err(bad(
                "does not exist; data.tokenizer names a tokenizer.json".into()
            ));
        }
        let tokenizer = Tokenizer::from_file(path)
            .map_err(|e| bad(format!("is not a tokenizers tokenizer.json: {e}")))?;
        let eos_name = match &spec.eos_token {
            Some(name) => name.clone(),
            None => eos_from_config(path).unwrap_or_default(),
        };
        let candidates = [eos_name.as_str(), "<|endoftext|>", "</s>", "<eos>", "[SEP]"];
        let (name, eos) = candidates
            .iter()
            .filter(|n| !n.is_empty())
            .find_map(|n| tokenizer.token_to_id(n).map(|id| (*n, id)))
            .ok_or_else(|| {
                bad(format!(
                    "has no end-of-sequence token{}; set data.eos-token to one of its tokens",
                    if eos_name.is_empty() {
                        String::new()
                    } else {
                        format!(" {eos_name:?}")
                    }
                ))
            })?;
        if spec.eos_token.as_deref().is_some_and(|n| n != name) {
            return Err(bad(format!(
                "has no token {:?} (data.eos-token)",
                spec.eos_token.as_deref().unwrap_or_default()
            )));
        }
        Ok(Self {
            tokenizer,
            eos,
            path: path.clone(),
        })
    }

    /// The vocabulary with added tokens: every id the tokenizer gives is
    /// below it.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The end-of-sequence id put after each document.
    pub fn eos(&self) -> u32 {
        self.eos
    }

    /// `texts` encoded as Python's `encode_batch(texts)` encodes them
    /// (special tokens added as the tokenizer's post-processor says).
    pub fn encode_batch(&self, texts: Vec<String>) -> Result<Vec<Vec<u32>>, DataError> {
        let encodings =
            self.tokenizer
                .encode_batch(texts, true)
                .map_err(|e| DataError::Format {
                    path: self.path.clone(),
                    message: format!("failed to encode: {e}"),
                })?;
        Ok(encodings
            .into_iter()
            .map(|e| e.get_ids().to_vec())
            .collect())
    }
}

/// `eos_token` of the `tokenizer_config.json` beside `tokenizer` (a string
/// or `{"content": ...}`).
fn eos_from_config(tokenizer: &Path) -> Option<String> {
    let config = tokenizer.with_file_name("tokenizer_config.json");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(config).ok()?).ok()?;
    match &json["eos_token"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Where the token cache of `spec` lies: `.hearth-cache/<key>.npy` beside
/// its first file, the key hashing every input of the tokenization.
pub fn cache_path(spec: &DocumentsSpec, tokenizer: &LoadedTokenizer) -> Result<PathBuf, DataError> {
    let mut hash = Sha256::new();
    hash.update(CACHE_FORMAT);
    for file in std::iter::once(&spec.tokenizer).chain(&spec.files) {
        let mut f = std::fs::File::open(file).map_err(|source| DataError::Read {
            path: file.clone(),
            source,
        })?;
        std::io::copy(&mut f, &mut hash).map_err(|source| DataError::Read {
            path: file.clone(),
            source,
        })?;
        hash.update([0xff]);
    }
    hash.update(format!(
        "{:?}\0{}\0{}",
        spec.format, spec.text_field, tokenizer.eos
    ));
    let key = hex::encode(&hash.finalize()[..16]);
    let folder = spec.files[0].parent().unwrap_or(Path::new("."));
    Ok(folder.join(".hearth-cache").join(format!("{key}.npy")))
}

/// Calls `each` with every document's text, in file order, with where it
/// came from for error messages.
fn for_each_document(
    spec: &DocumentsSpec,
    mut each: impl FnMut(String, u64) -> Result<(), DataError>,
) -> Result<(), DataError> {
    for file in &spec.files {
        match spec.format {
            DocumentFormat::Jsonl => read_jsonl(file, &spec.text_field, &mut each)?,
            DocumentFormat::Parquet => read_parquet(file, &spec.text_field, &mut each)?,
        }
    }
    Ok(())
}

fn read_jsonl(
    file: &Path,
    field: &str,
    each: &mut impl FnMut(String, u64) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let read_err = |source| DataError::Read {
        path: file.into(),
        source,
    };
    let reader = std::io::BufReader::new(std::fs::File::open(file).map_err(read_err)?);
    for (n, line) in reader.lines().enumerate() {
        let line = line.map_err(read_err)?;
        let at = |message: String| DataError::Format {
            path: file.into(),
            message: format!("line {}: {message}", n + 1),
        };
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| at(format!("is not JSON ({e})")))?;
        let text = match value.get(field) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(at(format!(
                    "field {field:?} is not a string but {}",
                    kind_of_json(other)
                )))
            }
            None => {
                let keys: Vec<&str> = value
                    .as_object()
                    .map(|o| o.keys().map(String::as_str).collect())
                    .unwrap_or_default();
                return Err(at(format!(
                    "has no field {field:?} (it has {}); set data.text-field",
                    if keys.is_empty() {
                        "none".to_string()
                    } else {
                        keys.join(", ")
                    }
                )));
            }
        };
        let len = line.len() as u64 + 1;
        each(text, len)?;
    }
    Ok(())
}

fn kind_of_json(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn read_parquet(
    file: &Path,
    field: &str,
    each: &mut impl FnMut(String, u64) -> Result<(), DataError>,
) -> Result<(), DataError> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::RowAccessor;
    use parquet::schema::types::Type;
    let bad = |message: String| DataError::Format {
        path: file.into(),
        message,
    };
    let handle = std::fs::File::open(file).map_err(|source| DataError::Read {
        path: file.into(),
        source,
    })?;
    let reader = SerializedFileReader::new(handle)
        .map_err(|e| bad(format!("is not a Parquet file ({e})")))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let fields = schema.root_schema().get_fields();
    let Some(column) = fields.iter().find(|f| f.name() == field) else {
        let names: Vec<&str> = fields.iter().map(|f| f.name()).collect();
        return Err(bad(format!(
            "has no column {field:?} (it has {}); set data.text-field",
            names.join(", ")
        )));
    };
    let projection = Type::group_type_builder("schema")
        .with_fields(vec![column.clone()])
        .build()
        .map_err(|e| bad(e.to_string()))?;
    let rows = reader
        .get_row_iter(Some(projection))
        .map_err(|e| bad(format!("column {field:?} cannot be read ({e})")))?;
    for (n, row) in rows.enumerate() {
        let at = |message: String| bad(format!("row {n}: {message}"));
        let row = row.map_err(|e| at(e.to_string()))?;
        let text = row
            .get_string(0)
            .map_err(|_| at(format!("column {field:?} is not a string (or is null)")))?;
        let len = text.len() as u64;
        each(text.clone(), len)?;
    }
    Ok(())
}

/// Tokenizes every document of `spec` into `cache` (uint32 `.npy`): each
/// document's ids then the end-of-sequence id. Shows a progress bar over
/// the input's bytes when `progress`.
pub fn tokenize_into(
    spec: &DocumentsSpec,
    tokenizer: &LoadedTokenizer,
    cache: &Path,
    progress: bool,
) -> Result<u64, DataError> {
    let total: u64 = spec
        .files
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    let bar = if progress {
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "tokenizing {bar:30} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec})",
            )
            .expect("a valid template"),
        );
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut ids: Vec<u32> = Vec::new();
    let mut chunk: Vec<String> = Vec::with_capacity(CHUNK);
    let flush = |chunk: &mut Vec<String>, ids: &mut Vec<u32>| -> Result<(), DataError> {
        for doc in tokenizer.encode_batch(std::mem::take(chunk))? {
            ids.extend(doc);
            ids.push(tokenizer.eos);
        }
        Ok(())
    };
    for_each_document(spec, |text, bytes| {
        chunk.push(text);
        bar.inc(bytes);
        if chunk.len() == CHUNK {
            flush(&mut chunk, &mut ids)?;
        }
        Ok(())
    })?;
    flush(&mut chunk, &mut ids)?;
    bar.finish_and_clear();
    write_npy(cache, &ids)?;
    Ok(ids.len() as u64)
}

/// `ids` as a 1-D uint32 `.npy` at `path`, written atomically.
fn write_npy(path: &Path, ids: &[u32]) -> Result<(), DataError> {
    let folder = path.parent().unwrap_or(Path::new("."));
    let io = |source| DataError::Write {
        path: path.into(),
        source,
    };
    std::fs::create_dir_all(folder).map_err(io)?;
    let mut header = format!(
        "{{'descr': '<u4', 'fortran_order': False, 'shape': ({},), }}",
        ids.len()
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut tmp = tempfile::NamedTempFile::new_in(folder).map_err(io)?;
    {
        let mut out = std::io::BufWriter::new(tmp.as_file_mut());
        out.write_all(b"\x93NUMPY\x01\x00").map_err(io)?;
        out.write_all(&(header.len() as u16).to_le_bytes())
            .map_err(io)?;
        out.write_all(header.as_bytes()).map_err(io)?;
        for id in ids {
            out.write_all(&id.to_le_bytes()).map_err(io)?;
        }
        out.flush().map_err(io)?;
    }
    tmp.as_file().sync_all().map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(())
}
