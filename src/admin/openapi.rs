//! The OpenAPI 3.1 description of the lock API (traffic listener) and the
//! admin API, served at admin `GET /openapi.json`.
//!
//! Written by hand in `docs/openapi.json` and compiled in, so the document
//! in the repository is byte for byte the one served. Hand-written rather
//! than generated because the answers are built from problem documents and
//! `serde_json` values in one place each (`error`, the handlers), which
//! annotations would only repeat; the tests keep it honest instead: they
//! validate it against the OpenAPI 3.1 meta-schema and check real answers
//! against its schemas.

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue};

/// The document, as kept in the repository.
pub const DOCUMENT: &str = include_str!("../../docs/openapi.json");

/// `GET /openapi.json`.
pub async fn serve() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        DOCUMENT,
    )
        .into_response()
}
