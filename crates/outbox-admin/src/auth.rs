//! Who may see and change what, and the headers every response carries.
//!
//! Named tokens guard the console (`--admin-token`, named `admin`, and the
//! lines of `--admin-tokens-file`, one per person or script): the name is
//! who the audit trail says made a change. Scripts send a token as
//! `Authorization: Bearer <token>`; browsers post it once to `/login` and
//! get a session cookie that carries its name. Without a token the console
//! is read-only (and the CLI refuses to listen anywhere but loopback).
//!
//! Nothing is stored per session: the cookie is `issued.name.nonce.tag`,
//! the tag an HMAC-SHA256 of the rest under a key drawn at startup, so a
//! restart ends every session and a forged or edited cookie fails the tag
//! (a name cannot be changed without it). Each
//! session's CSRF token is the HMAC of its nonce under the same key (with
//! another label): mutations from a browser post it in a hidden field, which
//! a page of another origin cannot read. Bearer requests carry no ambient
//! credential and need no CSRF token.
//!
//! Every comparison with a secret goes through [`Mac::verify_slice`], which
//! is constant-time. The token is never logged, and its `Debug` is redacted.
//!
//! Not the `cookie` crate's signed jar (nor axum-extra's): it would sign the
//! value, but the session's expiry (a browser's `Max-Age` is only a hint),
//! the CSRF token and the token's tag need this keyed HMAC anyway, so it
//! would replace a few lines with a dependency and a second key.

use std::fmt;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use chrono::Utc;
use hmac::{Hmac, Mac};
use maud::html;
use sha2::Sha256;

use crate::form::Params;
use crate::view;

type HmacSha256 = Hmac<Sha256>;

/// The session cookie's name.
const COOKIE: &str = "outbox_admin";
/// How long a browser session lasts.
const SESSION_SECONDS: i64 = 12 * 3600;
/// The shortest token accepted: a guessable token on a console that
/// requeues events is worse than none.
pub const MIN_TOKEN_LEN: usize = 16;

/// The Content-Security-Policy of every response: no script at all, styles
/// and images from the console itself (and inline `data:` images), forms
/// posting only back to it, never framed.
pub const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; \
                       frame-ancestors 'none'; base-uri 'none'";

/// The name `--admin-token` signs in as.
pub const DEFAULT_NAME: &str = "admin";

/// An admin token, redacted in `Debug`.
#[derive(Clone)]
pub struct Token(String);

impl Token {
    /// A token of at least [`MIN_TOKEN_LEN`] characters, else None.
    pub fn new(token: String) -> Option<Token> {
        (token.chars().count() >= MIN_TOKEN_LEN).then_some(Token(token))
    }

    /// Whether two tokens are the same secret (at startup, to refuse one
    /// token under two names).
    pub fn same_as(&self, other: &Token) -> bool {
        self.0 == other.0
    }
}

/// A token and the name the audit trail records for what it changes.
#[derive(Clone, Debug)]
pub struct NamedToken {
    /// Who holds it: letters, digits and `_ - @ .`, at most 64.
    pub name: String,
    /// The secret.
    pub token: Token,
}

/// Why a tokens file was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokensError {
    /// A line is not `name token`.
    #[error(
        "line {line}: expected `name token` (a name, a space, a token of at least {MIN_TOKEN_LEN} characters)"
    )]
    Malformed {
        /// 1-based.
        line: usize,
    },
    /// A name has characters the audit trail and cookies do not take.
    #[error("line {line}: name {name:?} must be 1 to 64 letters, digits or `_ - @ .`")]
    BadName {
        /// 1-based.
        line: usize,
        /// The name as written.
        name: String,
    },
    /// A token is too short to guard a console that requeues events.
    #[error("line {line}: the token of {name:?} is shorter than {MIN_TOKEN_LEN} characters")]
    Short {
        /// 1-based.
        line: usize,
        /// Whose token.
        name: String,
    },
    /// Two lines name the same person, or hold the same token.
    #[error("line {line}: {what} already given on an earlier line")]
    Duplicate {
        /// 1-based.
        line: usize,
        /// `name "alice"` or `the token of "bob"`.
        what: String,
    },
}

/// Whether `name` may name a token: printable in a log line and an audit
/// row without quoting, and free of the cookie's separators.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '@' | '.'))
}

/// Parses a tokens file: `name token` per line, blank lines and `#`
/// comments skipped.
pub fn parse_tokens(text: &str) -> Result<Vec<NamedToken>, TokensError> {
    let mut out: Vec<NamedToken> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let mut parts = trimmed.split_whitespace();
        let (Some(name), Some(token), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(TokensError::Malformed { line });
        };
        if !valid_name(name) {
            return Err(TokensError::BadName {
                line,
                name: name.to_owned(),
            });
        }
        let Some(token) = Token::new(token.to_owned()) else {
            return Err(TokensError::Short {
                line,
                name: name.to_owned(),
            });
        };
        if let Some(other) = out.iter().find(|t| t.name == name || t.token.0 == token.0) {
            let what = if other.name == name {
                format!("name {name:?}")
            } else {
                format!("the token of {:?}", other.name)
            };
            return Err(TokensError::Duplicate { line, what });
        }
        out.push(NamedToken {
            name: name.to_owned(),
            token,
        });
    }
    Ok(out)
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// The secrets of one console process.
pub(crate) struct Auth {
    /// Each token's name and HMAC under `key`, which a presented token's
    /// HMAC must equal; empty: no token, read-only.
    tokens: Vec<(String, Vec<u8>)>,
    key: [u8; 32],
    secure_cookie: bool,
}

/// What a request may do, found by [`guard`].
#[derive(Clone, Debug)]
pub(crate) enum Access {
    /// No token is configured: anyone who reaches the console reads,
    /// nobody changes anything.
    ReadOnly,
    /// A right bearer token, and whose it is.
    Bearer {
        /// The token's name.
        who: String,
    },
    /// A browser session; its mutations need [`Auth::csrf`] of `session`.
    Session {
        /// The signed part of the cookie.
        session: String,
        /// The CSRF token its forms carry.
        csrf: String,
        /// The name of the token it signed in with.
        who: String,
    },
}

impl Access {
    /// The CSRF token forms must carry (empty when none is needed).
    pub(crate) fn csrf(&self) -> &str {
        match self {
            Access::Session { csrf, .. } => csrf,
            Access::ReadOnly | Access::Bearer { .. } => "",
        }
    }

    /// Whether mutations are possible at all.
    pub(crate) fn may_change(&self) -> bool {
        !matches!(self, Access::ReadOnly)
    }

    /// Who did it, for the audit trail and the log line of a mutation:
    /// the token's name.
    pub(crate) fn who(&self) -> &str {
        match self {
            Access::ReadOnly => "anonymous",
            Access::Bearer { who } | Access::Session { who, .. } => who,
        }
    }

    /// How the request proved it, for the log line of a mutation.
    pub(crate) fn via(&self) -> &'static str {
        match self {
            Access::ReadOnly => "no token",
            Access::Bearer { .. } => "bearer token",
            Access::Session { .. } => "browser session",
        }
    }
}

impl Auth {
    pub(crate) fn new(tokens: Vec<NamedToken>, secure_cookie: bool) -> Auth {
        let key: [u8; 32] = rand::random();
        let tokens = tokens
            .into_iter()
            .map(|t| (t.name, mac(&key, b"token", t.token.0.as_bytes())))
            .collect();
        Auth {
            tokens,
            key,
            secure_cookie,
        }
    }

    /// Whether any token is configured (else the console is read-only).
    fn guarded(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Whose token `presented` is, comparing with every token in constant
    /// time.
    fn token_name(&self, presented: &str) -> Option<&str> {
        let found = keyed(&self.key, b"token", presented.as_bytes());
        self.tokens
            .iter()
            .find(|(_, tag)| found.clone().verify_slice(tag).is_ok())
            .map(|(name, _)| name.as_str())
    }

    fn sign(&self, session: &str) -> Vec<u8> {
        mac(&self.key, b"session", session.as_bytes())
    }

    /// The CSRF token of a session.
    fn csrf(&self, session: &str) -> String {
        B64.encode(mac(&self.key, b"csrf", session.as_bytes()))
    }

    /// A fresh session cookie's value for the token named `who`.
    fn new_session(&self, who: &str) -> String {
        let nonce: [u8; 18] = rand::random();
        let session = format!(
            "{}.{}.{}",
            Utc::now().timestamp(),
            B64.encode(who),
            B64.encode(nonce)
        );
        format!("{session}.{}", B64.encode(self.sign(&session)))
    }

    /// The session a cookie value proves and whose it is, if its tag holds,
    /// it has not expired and its token is still configured.
    fn session(&self, cookie: &str) -> Option<(String, String)> {
        let (session, tag) = cookie.rsplit_once('.')?;
        let tag = B64.decode(tag).ok()?;
        keyed(&self.key, b"session", session.as_bytes())
            .verify_slice(&tag)
            .ok()?;
        let mut parts = session.splitn(3, '.');
        let issued: i64 = parts.next()?.parse().ok()?;
        let who = String::from_utf8(B64.decode(parts.next()?).ok()?).ok()?;
        let age = Utc::now().timestamp() - issued;
        let known = self.tokens.iter().any(|(name, _)| *name == who);
        ((0..SESSION_SECONDS).contains(&age) && known).then(|| (session.to_owned(), who))
    }

    /// Whether a posted CSRF token is the session's, in constant time.
    fn csrf_holds(&self, session: &str, posted: &str) -> bool {
        B64.decode(posted).is_ok_and(|tag| {
            keyed(&self.key, b"csrf", session.as_bytes())
                .verify_slice(&tag)
                .is_ok()
        })
    }

    fn cookie(&self, value: &str, max_age: i64) -> String {
        // `Secure` would make a browser drop the cookie over plain HTTP,
        // which is what loopback (tests, an SSH tunnel) speaks.
        let secure = if self.secure_cookie { "; Secure" } else { "" };
        format!("{COOKIE}={value}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}{secure}")
    }
}

/// An HMAC-SHA256 keyed with `key`, over `label`, a zero byte and `data`:
/// the labels keep the session, CSRF and token MACs apart.
fn keyed(key: &[u8], label: &[u8], data: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(label);
    mac.update(&[0]);
    mac.update(data);
    mac
}

fn mac(key: &[u8], label: &[u8], data: &[u8]) -> Vec<u8> {
    keyed(key, label, data).finalize().into_bytes().to_vec()
}

/// Finds what the request may do and puts it in the request's extensions;
/// refuses it (401) when a token is set and the request proves none. The
/// login page and the stylesheet are open.
pub(crate) async fn guard(
    State(auth): State<std::sync::Arc<Auth>>,
    mut request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    if path == "/login" || path == "/admin.css" {
        return next.run(request).await;
    }
    let api = path.starts_with("/api/") || path.contains("/api/");
    let access = if !auth.guarded() {
        Some(Access::ReadOnly)
    } else if let Some(bearer) = bearer(&request) {
        let Some(who) = auth.token_name(bearer) else {
            tracing::warn!(path, "admin: wrong bearer token");
            return if api {
                crate::api::problem(StatusCode::UNAUTHORIZED, "wrong token")
            } else {
                (StatusCode::UNAUTHORIZED, "wrong token\n").into_response()
            };
        };
        Some(Access::Bearer { who: who.to_owned() })
    } else {
        cookie(&request)
            .and_then(|c| auth.session(c))
            .map(|(session, who)| Access::Session {
                csrf: auth.csrf(&session),
                session,
                who,
            })
    };
    match access {
        Some(access) => {
            request.extensions_mut().insert(access);
            next.run(request).await
        }
        None if api => crate::api::problem(
            StatusCode::UNAUTHORIZED,
            "this console needs a token: send Authorization: Bearer <token>",
        ),
        None => login_form(StatusCode::UNAUTHORIZED, None),
    }
}

/// Checks that `access` may change rows with this form: a token is set,
/// and a browser session posted its CSRF token. Some: the refusal to send,
/// on a page framed by `frame`.
pub(crate) fn refusal(auth: &Auth, frame: &view::Frame, access: &Access, form: &Params) -> Option<Response> {
    let refuse = |message: &str| view::message_page(StatusCode::FORBIDDEN, "Refused", access, frame, message);
    match access {
        Access::ReadOnly => Some(refuse(
            "This console is read-only: start `outbox admin` with --admin-token (or OUTBOX_ADMIN_TOKEN) to requeue or give up on dead letters.",
        )),
        Access::Bearer { .. } => None,
        Access::Session { session, .. } => {
            if auth.csrf_holds(session, form.get("csrf").unwrap_or("")) {
                None
            } else {
                tracing::warn!("admin: mutation refused: missing or wrong CSRF token");
                Some(refuse(
                    "Missing or wrong CSRF token: go back, reload the page and try again.",
                ))
            }
        }
    }
}

fn bearer(request: &Request) -> Option<&str> {
    let value = request.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
}

fn cookie(request: &Request) -> Option<&str> {
    request
        .headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='))
}

/// `GET /login`.
pub(crate) async fn login_page(State(auth): State<std::sync::Arc<Auth>>) -> Response {
    if !auth.guarded() {
        return Redirect::to("/").into_response();
    }
    login_form(StatusCode::OK, None)
}

fn login_form(status: StatusCode, problem: Option<&str>) -> Response {
    let body = html! {
        h1 { "outbox admin" }
        @if let Some(problem) = problem { p.error { (problem) } }
        form.login method="post" action="/login" {
            label for="token" { "Admin token" }
            input #token type="password" name="token" autocomplete="current-password" autofocus;
            button type="submit" { "Sign in" }
        }
    };
    (status, view::bare("Sign in", body)).into_response()
}

/// `POST /login`: the token from the form; a session cookie if it is right.
pub(crate) async fn login(State(auth): State<std::sync::Arc<Auth>>, body: axum::body::Bytes) -> Response {
    if !auth.guarded() {
        return Redirect::to("/").into_response();
    }
    let form = Params::parse(&body);
    let Some(who) = auth.token_name(form.get("token").unwrap_or("")) else {
        tracing::warn!("admin: sign-in with a wrong token");
        return login_form(StatusCode::UNAUTHORIZED, Some("Wrong token."));
    };
    tracing::info!(who, "admin: browser session started");
    let cookie = auth.cookie(&auth.new_session(who), SESSION_SECONDS);
    let mut response = Redirect::to("/").into_response();
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// `POST /logout`: forgets the cookie in this browser. The session itself
/// stays valid until it expires or the console restarts (nothing is stored
/// to revoke), so the form needs the CSRF token like any mutation.
pub(crate) async fn logout(
    State(auth): State<std::sync::Arc<Auth>>,
    axum::Extension(access): axum::Extension<Access>,
    body: axum::body::Bytes,
) -> Response {
    let frame = view::Frame {
        label: String::new(),
        base: None,
        fleet: false,
    };
    if let Some(refused) = refusal(&auth, &frame, &access, &Params::parse(&body)) {
        return refused;
    }
    let mut response = Redirect::to("/login").into_response();
    if let Ok(value) = HeaderValue::from_str(&auth.cookie("", 0)) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// Adds the security headers to every response.
pub(crate) async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth() -> Auth {
        let tokens =
            parse_tokens("admin 0123456789abcdef\n# a comment\n\nalice@example.com fedcba9876543210\n")
                .unwrap();
        Auth::new(tokens, false)
    }

    #[test]
    fn tokens_sessions_and_csrf_tokens_verify_and_forgeries_do_not() {
        let a = auth();
        assert_eq!(a.token_name("0123456789abcdef"), Some("admin"));
        assert_eq!(a.token_name("fedcba9876543210"), Some("alice@example.com"));
        assert_eq!(a.token_name("0123456789abcdeF"), None);
        assert_eq!(a.token_name(""), None);
        let cookie = a.new_session("alice@example.com");
        let (session, who) = a.session(&cookie).expect("a fresh cookie holds");
        assert_eq!(who, "alice@example.com");
        assert!(a.csrf_holds(&session, &a.csrf(&session)));
        assert!(!a.csrf_holds(&session, ""));
        assert!(!a.csrf_holds(&session, &a.csrf("1.other")));
        // Another process's key, an edited timestamp, an expired session.
        assert!(auth().session(&cookie).is_none());
        let (issued, rest) = cookie.split_once('.').unwrap();
        assert!(
            a.session(&format!("{}.{rest}", issued.parse::<i64>().unwrap() + 1))
                .is_none()
        );
        let old = format!(
            "{}.{}.nonce",
            Utc::now().timestamp() - SESSION_SECONDS - 1,
            B64.encode("admin")
        );
        assert!(
            a.session(&format!("{old}.{}", B64.encode(a.sign(&old))))
                .is_none()
        );
    }

    #[test]
    fn a_session_of_a_name_no_token_has_is_refused() {
        let a = auth();
        let session = format!("{}.{}.nonce", Utc::now().timestamp(), B64.encode("mallory"));
        assert!(
            a.session(&format!("{session}.{}", B64.encode(a.sign(&session))))
                .is_none()
        );
    }

    #[test]
    fn tokens_files_are_checked_line_by_line() {
        assert_eq!(
            parse_tokens("alice short").unwrap_err(),
            TokensError::Short {
                line: 1,
                name: "alice".into()
            }
        );
        assert_eq!(
            parse_tokens("\nalice").unwrap_err(),
            TokensError::Malformed { line: 2 }
        );
        assert_eq!(
            parse_tokens("al ice 0123456789abcdef").unwrap_err(),
            TokensError::Malformed { line: 1 }
        );
        assert!(matches!(
            parse_tokens("a/b 0123456789abcdef"),
            Err(TokensError::BadName { line: 1, .. })
        ));
        assert!(matches!(
            parse_tokens("a 0123456789abcdef\nb 0123456789abcdef"),
            Err(TokensError::Duplicate { line: 2, .. })
        ));
        assert!(matches!(
            parse_tokens("a 0123456789abcdef\na 0123456789abcdeX"),
            Err(TokensError::Duplicate { line: 2, .. })
        ));
    }

    #[test]
    fn short_tokens_are_refused_and_tokens_never_print() {
        assert!(Token::new("short".into()).is_none());
        let t = Token::new("0123456789abcdef".into()).unwrap();
        assert_eq!(format!("{t:?}"), "Token(<redacted>)");
    }
}
