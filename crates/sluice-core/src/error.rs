//! One error type for the whole engine. Every variant names what it is about (a
//! file, a tensor, a value) so that the CLI can print a single line that a user can
//! act on.

use std::path::{Path, PathBuf};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file whose structure is wrong: bad header, truncated, offsets out of range.
    #[error("{}: {msg}", path.display())]
    Format { path: PathBuf, msg: String },
    /// A config file that cannot be read or says something sluice cannot run.
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },
    #[error("unsupported model type '{model_type}' in {} (supported: {supported})", path.display())]
    UnknownArchitecture { path: PathBuf, model_type: String, supported: String },
    #[error("tensor '{name}' is missing from {}", path.display())]
    MissingTensor { path: PathBuf, name: String },
    #[error("tensor '{name}' in {} has {got}, expected {expected}", path.display())]
    TensorShape { path: PathBuf, name: String, expected: String, got: String },
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange { id: u64, vocab_size: usize },
    #[error("the sequence needs {needed} positions but the context holds {limit}")]
    ContextTooLong { needed: usize, limit: usize },
    #[error("tokenizer {}: {msg}", path.display())]
    Tokenizer { path: PathBuf, msg: String },
    #[error("chat template: {0}")]
    Template(String),
    /// A bad command-line value or combination of values.
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Unsupported(String),
    /// A GPU that cannot be reached or an operation on it that failed (the driver's
    /// message, and what was being done).
    #[error("{0}")]
    Device(String),
}

impl Error {
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        Error::Io { path: path.as_ref().to_path_buf(), source }
    }
    pub fn format(path: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        Error::Format { path: path.as_ref().to_path_buf(), msg: msg.into() }
    }
    pub fn config(path: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        Error::Config { path: path.as_ref().to_path_buf(), msg: msg.into() }
    }
    pub fn tokenizer(path: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        Error::Tokenizer { path: path.as_ref().to_path_buf(), msg: msg.into() }
    }

    /// The same error again, for each of several requests it ends (an I/O error
    /// keeps its kind and message; `std::io::Error` is not `Clone`).
    pub fn duplicate(&self) -> Error {
        match self {
            Error::Io { path, source } => {
                Error::Io { path: path.clone(), source: std::io::Error::new(source.kind(), source.to_string()) }
            }
            Error::Format { path, msg } => Error::Format { path: path.clone(), msg: msg.clone() },
            Error::Config { path, msg } => Error::Config { path: path.clone(), msg: msg.clone() },
            Error::UnknownArchitecture { path, model_type, supported } => Error::UnknownArchitecture {
                path: path.clone(),
                model_type: model_type.clone(),
                supported: supported.clone(),
            },
            Error::MissingTensor { path, name } => Error::MissingTensor { path: path.clone(), name: name.clone() },
            Error::TensorShape { path, name, expected, got } => Error::TensorShape {
                path: path.clone(),
                name: name.clone(),
                expected: expected.clone(),
                got: got.clone(),
            },
            Error::TokenOutOfRange { id, vocab_size } => Error::TokenOutOfRange { id: *id, vocab_size: *vocab_size },
            Error::ContextTooLong { needed, limit } => Error::ContextTooLong { needed: *needed, limit: *limit },
            Error::Tokenizer { path, msg } => Error::Tokenizer { path: path.clone(), msg: msg.clone() },
            Error::Template(m) => Error::Template(m.clone()),
            Error::Usage(m) => Error::Usage(m.clone()),
            Error::Unsupported(m) => Error::Unsupported(m.clone()),
            Error::Device(m) => Error::Device(m.clone()),
        }
    }
}
