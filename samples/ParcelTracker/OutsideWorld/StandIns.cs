using System.Globalization;
using Microsoft.EntityFrameworkCore;

namespace ParcelTracker.OutsideWorld;

/// <summary>
/// The carrier's API: books (and charges for) a pickup slot per call. Whether it honours idempotency keys depends on
/// the carrier; it can list the bookings made for a parcel, which is what a reconciliation asks.
/// </summary>
public interface ICarrierApiClient
{
    Task<string> ReservePickupSlotAsync(Guid parcelId, string destination, Guid idempotencyKey, CancellationToken cancellationToken = default);

    /// <summary>The slot booked for <paramref name="parcelId"/>, or null if none was booked.</summary>
    Task<string?> FindReservationAsync(Guid parcelId, CancellationToken cancellationToken = default);
}

/// <summary>The SMS gateway: sends one message per call (once per idempotency key, if it honours them).</summary>
public interface INotificationService
{
    Task SendSmsAsync(Guid parcelId, string text, Guid idempotencyKey, CancellationToken cancellationToken = default);
}

/// <summary>How the stand-ins behave: <c>--carrier-honours-keys true|false</c>, <c>--sms-honours-keys true|false</c> (both default true).</summary>
public sealed record OutsideWorldSettings(bool CarrierHonoursKeys, bool SmsHonoursKeys)
{
    public static OutsideWorldSettings From(IConfiguration configuration) => new(
        configuration.GetValue("CarrierHonoursKeys", true),
        configuration.GetValue("SmsHonoursKeys", true));
}

/// <summary>
/// A carrier stand-in that behaves like the remote service: a call is a booking, recorded (committed) on its own
/// connection before it answers. Honouring keys, a repeated key returns the first booking and only counts the call.
/// </summary>
public sealed class RecordingCarrierApiClient(IDbContextFactory<OutsideWorldDbContext> outsideWorld, OutsideWorldSettings settings, TimeProvider clock) : ICarrierApiClient
{
    public async Task<string> ReservePickupSlotAsync(Guid parcelId, string destination, Guid idempotencyKey, CancellationToken cancellationToken = default)
    {
        DateTime now = clock.GetUtcNow().UtcDateTime;
        await using var db = await outsideWorld.CreateDbContextAsync(cancellationToken);
        if (settings.CarrierHonoursKeys && await db.CarrierReservations.FirstOrDefaultAsync(r => r.IdempotencyKey == idempotencyKey, cancellationToken) is { } earlier)
        {
            earlier.Calls++;
            await db.SaveChangesAsync(cancellationToken);
            return earlier.Slot;
        }

        string slot = now.AddDays(1).ToString("yyyy-MM-dd", CultureInfo.InvariantCulture) + "/" + (Math.Abs(parcelId.GetHashCode()) % 8 + 9).ToString("00", CultureInfo.InvariantCulture) + ":00";
        db.CarrierReservations.Add(new CarrierReservation { ParcelId = parcelId, Slot = slot, IdempotencyKey = idempotencyKey, Calls = 1, ReceivedAt = now });
        await db.SaveChangesAsync(cancellationToken);
        return slot;
    }

    public async Task<string?> FindReservationAsync(Guid parcelId, CancellationToken cancellationToken = default)
    {
        await using var db = await outsideWorld.CreateDbContextAsync(cancellationToken);
        return await db.CarrierReservations.Where(r => r.ParcelId == parcelId).OrderBy(r => r.Id).Select(r => r.Slot).FirstOrDefaultAsync(cancellationToken);
    }
}

/// <summary>An SMS stand-in: a call is a sent SMS, recorded on its own connection; honouring keys, a repeated key is only counted.</summary>
public sealed class RecordingNotificationService(IDbContextFactory<OutsideWorldDbContext> outsideWorld, OutsideWorldSettings settings, TimeProvider clock) : INotificationService
{
    public async Task SendSmsAsync(Guid parcelId, string text, Guid idempotencyKey, CancellationToken cancellationToken = default)
    {
        await using var db = await outsideWorld.CreateDbContextAsync(cancellationToken);
        if (settings.SmsHonoursKeys && await db.NotificationsSent.FirstOrDefaultAsync(n => n.IdempotencyKey == idempotencyKey, cancellationToken) is { } earlier)
        {
            earlier.Calls++;
            await db.SaveChangesAsync(cancellationToken);
            return;
        }

        db.NotificationsSent.Add(new NotificationSent { ParcelId = parcelId, Text = text, IdempotencyKey = idempotencyKey, Calls = 1, ReceivedAt = clock.GetUtcNow().UtcDateTime });
        await db.SaveChangesAsync(cancellationToken);
    }
}
